"""Tiny randomly initialised targets of each supported family, for tests and smoke runs (seconds on CPU)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

FAMILIES = ("llama", "qwen3", "gemma3")


def tiny_config(family: str, num_layers: int = 10, vocab_size: int = 128, hidden_size: int = 32):
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=512, eos_token_id=vocab_size - 1, bos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=True)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "gemma3":
        # Mixed sliding-window / full attention, with a window short enough that tests cross it.
        return Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=8,
                                layer_types=["sliding_attention" if (i + 1) % 3 else "full_attention"
                                             for i in range(num_layers)])
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def tiny_model(family: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), dtype=torch.float32)
    # Random init gives near-uniform next-token distributions; sharpen them so greedy decoding is decisive.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    return model.eval().requires_grad_(False)
