"""One target forward over the rows of several sequences, each attending only to its own KV cache.

The rows of every sequence (a decode step's token, a chain's drafts, a tree's nodes) are laid side by side in one
[1, R, d] batch, so the embeddings, projections, norms and MLPs of all of them run as one matrix product — the part
whose cost barely grows with rows on these CPUs (design §9). Attention cannot be shared: each sequence has its own
cache, of its own length. The target's own decoder layers still run (every family, untouched); only their attention
kernel changes, through transformers' public `AttentionInterface`: the cache handed to the layers
(`RaggedCache`) appends each sequence's slice of the new K/V to that sequence's `LayerKVCache`, and the registered
kernel (`spd_ragged`) attends each slice of queries to its own cache under its own mask, with the same SDPA call the
target makes for one sequence. Without a `ragged=` argument the kernel is that SDPA call, so registering it changes
nothing for one-sequence forwards.

Per sequence the numbers equal `StagedTarget.forward_all` over its rows alone up to the rounding of a matrix product
with more rows (the greedy decodes are compared in tests/test_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from spd.targets.kv_cache import LayerKVCache
from spd.targets.stages import StagedTarget

KERNEL = "spd_ragged"


@dataclass
class Segment:
    """One sequence's rows in a ragged forward."""
    ids: list[int]                        # the tokens fed, in cache order
    cache: LayerKVCache                   # the sequence's own cache; the rows are appended at its current length
    start: int                            # position of the first row (= the cache's length)
    offsets: list[int] | None = None      # a tree's rows: each row's position minus start (None: contiguous)
    visible: torch.Tensor | None = None   # [T, T] bool, a tree's ancestor mask among its rows (None: causal)


class RaggedCache:
    """What the layers see as their cache during a ragged forward: it routes each sequence's K/V to its own cache and
    keeps the views the kernel attends to."""

    def __init__(self, target: StagedTarget, segments: list[Segment]):
        for segment in segments:
            if segment.cache.lengths[0] != segment.start:
                raise ValueError(f"a segment starts at {segment.start} but its cache holds {segment.cache.lengths[0]}")
        self.segments = segments
        self.bounds = [0]
        for segment in segments:
            self.bounds.append(self.bounds[-1] + len(segment.ids))
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layer_types = target.layer_types
        self.masks: dict[str, list[torch.Tensor | None]] = {
            layer_type: [segment_mask(target, s, layer_type) for s in segments]
            for layer_type in set(target.layer_types)}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value [1, H_kv, R, hd] of every row; returns them unchanged (the kernel reads `views`)."""
        self.views = [s.cache.update(key[:, :, lo:hi], value[:, :, lo:hi], layer_idx)
                      for s, lo, hi in zip(self.segments, self.bounds, self.bounds[1:])]
        return key, value


def segment_mask(target: StagedTarget, s: Segment, layer_type: str) -> torch.Tensor | None:
    """The mask `forward_all` would make for this segment's rows alone ([1, 1, T, start + T] bool or None)."""
    t = len(s.ids)
    device = target.device
    if s.visible is None:
        positions = torch.arange(s.start, s.start + t, device=device)
        return target._mask(positions, s.start + t, layer_type)
    positions = s.start + torch.tensor(s.offsets, device=device)
    prefix = torch.ones(t, s.start, dtype=torch.bool, device=device)
    key_positions = torch.cat([torch.arange(s.start, device=device), positions])
    return target.explicit_mask(torch.cat([prefix, s.visible.to(device)], 1), positions, key_positions, layer_type)


def ragged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, ragged=None,
                     **kwargs):
    """query [1, H, R, hd]. With `ragged`, each segment's queries attend to its own cache; otherwise plain SDPA.
    Returns [1, R, H, hd] and no weights, as every transformers kernel does."""
    if ragged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    masks = ragged.masks[ragged.layer_types[module.layer_idx]]
    outs = []
    for i, (lo, hi) in enumerate(zip(ragged.bounds, ragged.bounds[1:])):
        keys, values = ragged.views[i]
        out, _ = sdpa_attention_forward(module, query[:, :, lo:hi], keys, values, masks[i], dropout=dropout,
                                        scaling=scaling)
        outs.append(out)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(KERNEL, ragged_attention)


def use_ragged_kernel(target: StagedTarget) -> None:
    """Make the target's layers call `ragged_attention` (once; plain SDPA for every other forward)."""
    if target.config._attn_implementation != KERNEL:
        target.model.set_attn_implementation(KERNEL)


def forward_segments(target: StagedTarget, segments: list[Segment], capture=frozenset()):
    """Every layer over every segment's rows in one pass. Returns H^L [1, R, d], {l: H^l [1, R, d]} and the row
    bounds (segment i's rows are bounds[i]..bounds[i + 1] - 1)."""
    use_ragged_kernel(target)
    device = target.device
    ids = torch.tensor([[token for s in segments for token in s.ids]], device=device)
    positions = torch.tensor([s.start + (s.offsets[j] if s.offsets is not None else j)
                              for s in segments for j in range(len(s.ids))], device=device)
    ragged = RaggedCache(target, segments)
    h0 = target.embed(ids)
    hidden, captured = target.run_layers(h0, positions, 0, target.num_layers, ragged, capture, ragged=ragged)
    if 0 in capture:
        captured[0] = h0
    return hidden, captured, ragged.bounds
