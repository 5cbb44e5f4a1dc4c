"""A `weights=q4` target's attention: the suite's own kernel (spd/csrc/row_ops.h), row-invariant by construction.

A GGUF's blocks make a target of their own — its products round differently from the float32 target's — so its
layers need not reproduce transformers' operators bit for bit; they need the row property, and they need to be cheap:
at 5 bits a weight a one-row step of SmolLM2 spent less time in its products than in ATen's dispatch around them.
Such a layer's norms, rotary embedding, MLP and residuals are C++ loops (spd/csrc/llama_layer.cpp), and its
attention this kernel: each row's visible keys in ascending cache slot (a draft tree's ancestors sit in node order,
so exactly the keys, in the order, of the one-row step at its position), their scores, a softmax with the suite's own
vector exp and the weighted values summed in key order — one sequence of operations per row, whatever else shares
the call. The decoder layers call it with the cache's keys (spd.targets.lean_layers); transformers' attention
interface reaches it for everything else that attends through the target's layers (the ragged batch's segments).
Another caller — a drafter's layer built from the target's config, a forward with autograd — gets transformers' SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from spd.targets import panel

KERNEL = "spd_own_rows"


def use(model: torch.nn.Module, level: str) -> None:
    """The model's attention modules attend with this kernel at `level` (its products' level)."""
    model.config._attn_implementation = KERNEL
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
            module.__dict__["_row_level"] = panel.LEVELS.index(level)


def level_of(module, query: torch.Tensor) -> int | None:
    """The level this module attends at here, or None where the kernel does not apply."""
    level = module.__dict__.get("_row_level")
    if level is None or query.device.type != "cpu" or query.dtype != torch.float32 or \
            (torch.is_grad_enabled() and query.requires_grad):
        return None
    return level


def own_rows_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [B, H, T, D], key/value [B, H_kv, S, D], attention_mask [1 or B, 1, T, S] or None -> [B, T, H, D] and
    no weights, as every transformers kernel returns."""
    level = level_of(module, query)
    if level is None or dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return panel._EXT.own_attention(query, key, value, attention_mask, scale, level), None


AttentionInterface.register(KERNEL, own_rows_attention)
AttentionMaskInterface.register(KERNEL, sdpa_mask)       # transformers' own forward builds SDPA's boolean masks
