"""Grouped-query attention over several query rows without copying the cache: the query heads that share a key/value
head are stacked as extra rows of one SDPA call over that head's keys.

Why: transformers' SDPA path packs a one-row step this way (`pack_gqa`), but a masked call of several rows on a CPU
(a draft chain or tree under verification) first repeats every layer's whole K/V cache once per query head of the
group (`repeat_kv`): on SmolLM2 (9 query heads, 3 KV heads) 60 copies of [1, 9, S, 64] a forward — 3.5–5 ms of a
43–73 ms forward of 2..16 rows on these CPUs, a verification's whole step over the one-row AR step at 2 rows. Packed,
each query row meets the same keys in the same kernel; its logits differ from the repeated path's by float32
rounding of the same size as both paths' distance from the one-row step (tests/test_gqa_attention.py).

The mask of a forward is packed once (`pack_mask`, by `StagedTarget.run_layers` and the ragged path's per-sequence
masks) rather than in each of the layers; a mask of the plain shape (transformers' own forward) is packed here.
CPU targets that attend with transformers' SDPA use it (`StagedTarget`); a row-invariant target keeps its own kernel
(spd.targets.invariant_attention), a CUDA target transformers' SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

KERNEL = "spd_packed_gqa"


def groups_of(config) -> int:
    """Query heads per key/value head (1: no grouping)."""
    heads = config.num_attention_heads
    return heads // (getattr(config, "num_key_value_heads", None) or heads)


def wanted(device: torch.device, config) -> bool:
    """Whether a target on this device should attend with this kernel: a CPU target with grouped heads that attends
    with transformers' SDPA (or already with this kernel: a second StagedTarget over the same model)."""
    return device.type == "cpu" and groups_of(config) > 1 and config._attn_implementation in ("sdpa", KERNEL)


def pack_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, 1, T, S] -> [B, 1, groups * T, S]: row j * T + t is row t, as the packed query's rows are ordered. With
    `dtype` (the queries'), a boolean mask comes back additive (0 where visible, -inf elsewhere): what SDPA would
    build from it in every layer (~12 µs a call here), built once a forward — the same bits."""
    packed = mask.repeat(1, 1, groups, 1)
    if dtype is None or packed.dtype != torch.bool:
        return packed
    return torch.zeros(packed.shape, dtype=dtype, device=packed.device).masked_fill_(~packed, float("-inf"))


def packed_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [B, H, T, D], key/value [B, H_kv, S, D], attention_mask [B, 1, T or H/H_kv * T, S] bool or additive.
    Returns [B, T, H, D] and no weights, as every transformers kernel does. No mask (a fresh causal pass) and anything
    else transformers' SDPA handles itself go to it. One masked row is packed here too: transformers packs it the
    same way, but not while torch.compile traces it, where it repeats the whole cache each layer instead (a device
    step's compiled forward)."""
    b, h, t, d = query.shape
    kv_heads = key.shape[1]
    groups = h // kv_heads
    if groups == 1 or attention_mask is None or kwargs.get("position_bias") is not None or \
            kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    mask = attention_mask if attention_mask.shape[-2] in (1, groups * t) else pack_mask(attention_mask, groups)
    # query head h reads key/value head h // groups, as repeat_kv pairs them
    out = F.scaled_dot_product_attention(query.reshape(b, kv_heads, groups * t, d), key, value, attn_mask=mask,
                                         dropout_p=dropout, scale=scaling)
    return out.reshape(b, h, t, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(KERNEL, packed_gqa_attention)
AttentionMaskInterface.register(KERNEL, sdpa_mask)       # transformers' own forward builds SDPA's boolean masks
