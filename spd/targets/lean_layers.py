"""A Llama decoder layer's forward as one function on a CPU: the same tensor operations, in the same order, as
transformers' LlamaDecoderLayer, its attention, MLP and RMSNorms (so the same bits — tests/test_lean_layers.py),
without the ~15 module calls, keyword-renaming and kernel-hub wrappers a layer pays for in Python. A one-row step of
SmolLM2 spends more time there than in its products once they read 4-bit blocks; this is a third of it.

Only a layer of exactly transformers' Llama classes is swapped (its attention, MLP and norms too): other families
keep their own forward."""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama


def _norm(norm: llama.LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm.forward, op for op
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanLlamaLayer(llama.LlamaDecoderLayer):
    """LlamaDecoderLayer with its forward written out (the class swapped in place by `lean`)."""

    suite_plain = llama.LlamaDecoderLayer       # transformers' own, for spd.targets.linears.plain_products

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}   # what the attention forwards
        residual = hidden_states                                            # [B, T, d]
        h = _norm(self.input_layernorm, hidden_states)
        shape = (*h.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj.forward(h).view(shape).transpose(1, 2)              # [B, H, T, hd]
        k = attn.k_proj.forward(h).view(shape).transpose(1, 2)              # [B, H_kv, T, hd]
        v = attn.v_proj.forward(h).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                       # [B, 1, T, hd]
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                       llama.eager_attention_forward)
        out, _ = attend(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
        out = attn.o_proj.forward(out.reshape(*shape[:-2], -1).contiguous())
        hidden_states = residual + out
        residual = hidden_states
        h = _norm(self.post_attention_layernorm, hidden_states)
        h = mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
        return residual + h


def _plain(layer: torch.nn.Module) -> bool:
    """A layer of exactly transformers' Llama classes, in eval mode (training keeps transformers' own forward)."""
    return (type(layer) is llama.LlamaDecoderLayer and type(layer.self_attn) is llama.LlamaAttention
            and type(layer.mlp) is llama.LlamaMLP and not layer.training
            and all(type(n) is llama.LlamaRMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm)))


def lean(model: torch.nn.Module) -> int:
    """Swap every plain Llama decoder layer of `model` for LeanLlamaLayer; returns how many were swapped."""
    count = 0
    for module in model.modules():
        if _plain(module):
            module.__class__ = LeanLlamaLayer
            count += 1
    return count
