"""Tiny randomly initialised targets of each supported family, for tests and smoke runs (seconds on CPU)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3_5TextConfig, Qwen3Config

FAMILIES = ("llama", "qwen3", "gemma3", "qwen3_5")
HYBRIDS = ("qwen3_5",)      # linear-attention layers beside attention (spd.targets.linear_states)


def hybrid_layer_types(num_layers: int, full_first: bool = False) -> list[str]:
    """Qwen3.5's pattern: three Gated DeltaNet (linear-attention) layers, then one full-attention layer; full_first
    puts a full-attention layer at index 0 (a stage that starts with attention)."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if full_first:
        types[0] = "full_attention"
    return types


def tiny_config(family: str, num_layers: int = 10, vocab_size: int = 128, hidden_size: int = 32,
                max_position_embeddings: int = 512, tied: bool = True, head_dim: int = 8, full_first: bool = False,
                linear: tuple[int, int, int, int] = (2, 8, 4, 8)):
    """linear: a hybrid's Gated DeltaNet heads (key heads, key head dim, value heads, value head dim)."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=max_position_embeddings, eos_token_id=vocab_size - 1, bos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=tied)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "gemma3":
        # Mixed sliding-window / full attention, with a window short enough that tests cross it.
        return Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=head_dim,
                                layer_types=["sliding_attention" if (i + 1) % 3 else "full_attention"
                                             for i in range(num_layers)])
    if family == "qwen3_5":
        # A hybrid: Gated DeltaNet layers (conv + recurrent state) with gated full attention every fourth layer. At
        # 10 layers and n = 5 the stage bounds 2 and 6 cut runs of linear layers.
        key_heads, key_dim, value_heads, value_dim = linear
        return Qwen3_5TextConfig(**common, layer_types=hybrid_layer_types(num_layers, full_first),
                                 linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                                 linear_key_head_dim=key_dim, linear_value_head_dim=value_dim, linear_conv_kernel_dim=4)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def tiny_model(family: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), dtype=torch.float32)
    # Random init gives near-uniform next-token distributions; sharpen them so greedy decoding is decisive.
    # Tied (the default) the model mostly repeats its last token; untied, its answers depend on the whole context.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)
    return model.eval().requires_grad_(False)


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained on a few sentences, with ChatML special tokens; no hub needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["What is 12*7? It is 84.", "Write a function that adds two numbers.", "The quick brown fox jumps."] * 4
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def tiny_target(family: str = "llama", seed: int = 0, **kwargs):
    """A tiny random target (model, tokenizer) whose special ids match the tokenizer."""
    tok = tiny_tokenizer()
    vocab = len(tok)
    model = tiny_model(family, seed=seed, vocab_size=vocab, **kwargs)
    model.config.eos_token_id = tok.eos_token_id
    model.config.bos_token_id = tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def save_tiny_target(path: str, family: str = "llama", seed: int = 0, **kwargs) -> None:
    """Write a tiny random target (model + tokenizer) as an HF directory, loadable with target=<path>."""
    model, tok = tiny_target(family, seed, **kwargs)
    model.save_pretrained(path)
    tok.save_pretrained(path)
