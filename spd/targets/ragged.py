"""One target forward over the rows of several sequences, each attending only to its own KV cache.

The rows of every sequence (a decode step's token, a chain's drafts, a tree's nodes) are laid side by side in one
[1, R, d] batch, so the embeddings, projections, norms and MLPs of all of them run as one matrix product — the part
whose cost barely grows with rows on these CPUs (design §9). Attention cannot be shared: each sequence has its own
cache, of its own length. The target's own decoder layers still run (every family, untouched); only their attention
kernel changes, through transformers' public `AttentionInterface`: the cache handed to the layers
(`RaggedCache`) appends each sequence's slice of the new K/V to that sequence's `LayerKVCache`, and the registered
kernel (`spd_ragged`) attends each slice of queries to its own cache under its own mask, with the same SDPA call the
target makes for one sequence. The kernel is switched on for the ragged forward only (`ragged_kernel`).

Per sequence the numbers equal `StagedTarget.forward_all` over its rows alone up to the rounding of a matrix product
with more rows (the greedy decodes are compared in tests/test_batch.py).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from spd.targets import invariant_attention
from spd.targets.gqa_attention import packed_gqa_attention
from spd.targets.invariant_attention import row_invariant_attention
from spd.targets.gated_delta import parents_of
from spd.targets.kv_cache import LayerKVCache
from spd.targets.linear_states import Group
from spd.targets.stages import StagedTarget

KERNEL = "spd_ragged"


@dataclass
class Segment:
    """One sequence's rows in a ragged forward: they are appended to its own cache, in order."""
    cache: LayerKVCache
    positions: list[int]                  # each row's position (contiguous after the cache, unless `visible`)
    visible: tuple[torch.Tensor, torch.Tensor] | None = None   # a tree's rows: ([T, S] bool, which of the cache's S
                                                               # rows after the append each sees; their positions [S])

    @classmethod
    def tree(cls, cache: LayerKVCache, start: int, tree) -> "Segment":
        """A draft tree's nodes (spd.verify.tree.DraftTree) after `start` cached positions, as `forward_all` feeds them."""
        positions = [start + depth for depth in tree.depths()]
        if tree.is_chain():
            return cls(cache, positions)
        t = len(tree)
        visible = torch.cat([torch.ones(t, start, dtype=torch.bool), tree.visibility()], 1)
        return cls(cache, positions, (visible, torch.tensor([*range(start), *positions])))


class RaggedCache:
    """What the layers see as their cache during a ragged forward: it routes each sequence's K/V to its own cache and
    keeps the views the kernel attends to."""

    def __init__(self, target: StagedTarget, segments: list[Segment], first_layer: int = 0):
        self.segments = segments
        self.bounds = [0]
        for segment in segments:
            self.bounds.append(self.bounds[-1] + len(segment.positions))
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._linear_groups: list[Group] | None = None
        # each segment attends with the target's own kernel (spd.targets.invariant_attention where row-invariant)
        self.attend = row_invariant_attention if target.row_invariant else \
            packed_gqa_attention if target.packed_gqa else sdpa_attention_forward
        self.layer_types = target.layer_types
        self.masks: dict[str, list[torch.Tensor | None]] = {
            layer_type: [segment_mask(target, s, first_layer, layer_type) for s in segments]
            for layer_type in set(target.layer_types)}

    def linear_groups(self, rows: int, parents=None) -> list[Group]:
        """A hybrid's linear-attention layers: each sequence's rows against its own cache's states, a tree's rows
        each from its parent's (spd.targets.gated_delta). The same for every layer of the forward: made once."""
        if self._linear_groups is None:
            self._linear_groups = [
                Group(s.cache.linear, None if s.visible is None else parents_of(s.visible[0], hi - lo), lo, hi)
                for s, lo, hi in zip(self.segments, self.bounds, self.bounds[1:])]
        return self._linear_groups

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value [1, H_kv, R, hd] of every row; returns them unchanged (the kernel reads `views`)."""
        self.views = [s.cache.update(key[:, :, lo:hi], value[:, :, lo:hi], layer_idx)
                      for s, lo, hi in zip(self.segments, self.bounds, self.bounds[1:])]
        return key, value


def segment_mask(target: StagedTarget, s: Segment, layer: int, layer_type: str) -> torch.Tensor | None:
    """The mask the one-sequence path makes for these rows ([1, 1, T, S] bool, or None: every cached key visible)."""
    device = target.device
    positions = torch.tensor(s.positions, device=device)
    if s.visible is None:
        length = s.cache.get_seq_length(layer)
        if s.positions[0] != length:
            raise ValueError(f"rows start at position {s.positions[0]} but the cache holds {length}")
        return target.attention_mask(target._mask(positions, length + len(s.positions), layer_type), len(positions))
    visible, keys = s.visible
    return target.attention_mask(target.explicit_mask(visible.to(device), positions, keys.to(device), layer_type),
                                 len(positions))


def ragged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, ragged=None,
                     **kwargs):
    """query [1, H, R, hd]. With `ragged`, each segment's queries attend to its own cache; otherwise plain SDPA.
    Returns [1, R, H, hd] and no weights, as every transformers kernel does."""
    if ragged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    attend = ragged.attend
    masks = ragged.masks[ragged.layer_types[module.layer_idx]]
    outs = []
    for i, (lo, hi) in enumerate(zip(ragged.bounds, ragged.bounds[1:])):
        keys, values = ragged.views[i]
        out, _ = attend(module, query[:, :, lo:hi], keys, values, masks[i], dropout=dropout, scaling=scaling)
        outs.append(out)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(KERNEL, ragged_attention)


_LINEAR = F.linear
CANDIDATES = range(2, 9)     # at 16 rows the AMD A/B was mixed, at 32 weight-first was slower
# The row counts this process multiplies weight-first. Which way is faster is the machine's: on the AMD EPYC
# machines of docs/serving.md ("Many sequences at once") weight-first made a batched step of 2 rows 34 ms against
# 68 and 8 rows 65 against 73; on an Intel Xeon with AMX it made them 96 against 46 and 127 against 93 ("Products
# chosen per machine"). Every single-process decoder of several rows installs its machine's measured choice
# (spd.targets.row_costs.use_machine_products); a process that installs none (a distributed stage) keeps this.
FEW_ROWS: frozenset[int] = frozenset(CANDIDATES)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for x [..., d_in] of a row count in FEW_ROWS, computed as (W x^T)^T. The same product; some CPUs'
    torch (MKL) runs `F.linear` over 2 or 3 rows as 2 or 3 one-row products (AMD EPYC: 2 rows of SmolLM2's MLP
    94 µs against 48 for one, the head 16 ms against 7), where the weight as the left operand takes 60 µs and
    2.6 ms. One row keeps `F.linear` (the solo path), and so does a row-invariant target (CPU bfloat16), whose
    every row must come out as the solo path's (spd.targets.invariant_attention)."""
    rows = x.numel() // x.shape[-1]
    if rows not in FEW_ROWS or x.device.type != "cpu" or invariant_attention.wanted(x.device, x.dtype):
        return _LINEAR(x, weight, bias)     # bfloat16's F.linear gives a row the same bits at every row count
    out = (weight @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


@contextmanager
def few_rows_products():
    """Every nn.Linear inside computes few rows with `few_rows_linear` (the decode loop is one thread: nothing else
    runs a Linear meanwhile)."""
    F.linear = few_rows_linear
    try:
        yield
    finally:
        F.linear = _LINEAR


@contextmanager
def ragged_kernel(target: StagedTarget):
    """The target's layers call `ragged_attention` inside, their own kernel again after: transformers builds its own
    masks by the implementation's name, so a model left on an unknown name would mask its next HF forward
    differently (Gemma 3's sliding layers did)."""
    model = target.model
    previous = target.config._attn_implementation
    # set_attn_implementation walks every module (~1 ms a forward, 4% of a batched SPD step); where every module
    # reads the model's own config, the config's setter (which recurses into its sub-configs) switches them all
    switch = (lambda name: setattr(model.config, "_attn_implementation", name)) if one_config(model) else \
        model.set_attn_implementation
    switch(KERNEL)
    try:
        with few_rows_products():
            yield
    finally:
        switch(previous)


_ONE_CONFIG: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def one_config(model: torch.nn.Module) -> bool:
    """Whether every module of `model` that has a config has the model's own (checked once per model)."""
    if model not in _ONE_CONFIG:
        _ONE_CONFIG[model] = all(m.config is model.config for m in model.modules()
                                 if isinstance(getattr(m, "config", None), PretrainedConfig))
    return _ONE_CONFIG[model]


def run_segments(target: StagedTarget, hidden: torch.Tensor, segments: list[Segment], start: int, end: int,
                 capture=frozenset()):
    """Layers start..end-1 over every segment's rows, hidden [1, R, d] (segment i's rows at bounds[i]..bounds[i+1]-1).
    Returns H^end [1, R, d], {l: H^l [1, R, d]} for captured l in (start, end], and the bounds."""
    positions = torch.tensor([p for s in segments for p in s.positions], device=target.device)
    ragged = RaggedCache(target, segments, start)
    with ragged_kernel(target):
        out, captured = target.run_layers(hidden, positions, start, end, ragged, capture, ragged=ragged)
    return out, captured, ragged.bounds


def run_rows(target: StagedTarget, hidden: torch.Tensor, segments: list[Segment], start: int, end: int,
             capture=frozenset()):
    """`run_segments`, except that one segment runs the one-sequence path (`run_layers` on its own cache): a
    stage that runs one sequence's rows computes them as that sequence's solo decode would."""
    if len(segments) > 1:
        return run_segments(target, hidden, segments, start, end, capture)
    (s,) = segments
    positions = torch.tensor(s.positions, device=target.device)
    out, captured = target.run_layers(hidden, positions, start, end, s.cache, capture, visible=s.visible)
    return out, captured, [0, len(s.positions)]


def exit_logits(target: StagedTarget, out: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    """The target's logits [V] of each segment's last row of out [1, R, d], in one head product (one segment: the
    one-sequence path's product); a segment of several rows that leave together (FlowSpec's) gets all of its rows'
    [k, V]."""
    if any(hi - lo > 1 for lo, hi in zip(bounds, bounds[1:])):
        return [target.logits(out[0, lo:hi]) if hi - lo > 1 else target.logits(out[0, lo])
                for lo, hi in zip(bounds, bounds[1:])]
    if len(bounds) == 2:
        return [target.logits(out[0, bounds[1] - 1])]
    with few_rows_products():
        return list(target.logits(out[0, [hi - 1 for hi in bounds[1:]]]))


def forward_segments(target: StagedTarget, ids: list[list[int]], segments: list[Segment], capture=frozenset()):
    """Every layer over every segment's tokens ids[i]. Returns H^L [1, R, d], {l: H^l [1, R, d]} (l = 0: the
    embeddings) and the row bounds."""
    h0 = target.embed(torch.tensor([[t for row in ids for t in row]], device=target.device))
    hidden, captured, bounds = run_segments(target, h0, segments, 0, target.num_layers, capture)
    if 0 in capture:
        captured[0] = h0
    return hidden, captured, bounds
