"""A hybrid target's linear-attention states, kept per position so that a rollback can return to them.

A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) carries two states from token to token: its causal convolution's last
`kernel` inputs (the conv state, [B, C, kernel]) and a recurrent state per value head ([B, H, d_k, d_v], float32).
Both have absorbed every token the layer saw, so a rejected draft cannot be cut off the end as attention rows can.
Each linear layer instead keeps the states it had after each of its last `rollback` + 1 positions in a ring of
preallocated slots (slot = position mod ring size); a rollback to length p reads slot p — nothing is recomputed.

The rows themselves run through `spd.targets.gated_delta`, one at a time, from their parent's state. A chain's rows
go straight into the ring. A draft tree's rows (and a pipeline's trees in flight, whose nodes hang off nodes an
earlier forward wrote) wait as pending rows, each with its parent's position, until `keep` names the path or
subtree that stays: its rows move down like attention rows, and those that form a chain from the ring's end join it.

A fixed-shape step (a CUDA graph's unit, spd.targets.fixed_step, spd.runtime.device_step) reads and writes the ring
by position tensors instead (`ring_index`): a row reads its parent's slot and writes its own, so a rollback is the
position alone, as it is for attention rows. Two rows past the ring serve it: a scratch row that writes at the
cache's last position land in (an idle pipeline stage's, whose state no row ever follows), and a row of zeros, the
state before a sequence's first token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ROLLBACK = 32    # positions behind the newest a linear layer can return to (a chain's rows, SPD's tokens in flight)


class Row(NamedTuple):
    parent: int                 # the cache position of the row it follows (-1: none, the sequence's first token)
    window: torch.Tensor        # [B, C, kernel] the conv window after this row
    state: torch.Tensor         # [B, H, d_k, d_v] the recurrent state after this row


class Group(NamedTuple):
    """Rows lo..hi-1 of a forward: one sequence's, run against its states (parents: cache positions, or None for a
    chain; spd.targets.gated_delta)."""
    states: "LinearStates"
    parents: list[int] | None
    lo: int
    hi: int


class LinearStates:
    def __init__(self, lengths: list[int], rollback: int = ROLLBACK, max_length: int | None = None):
        self.lengths = lengths          # the owning cache's per-layer lengths (shared, updated in place)
        self.slots = rollback + 1
        self.max_length = max_length    # a static cache's positions (fixed-shape steps need one)
        num_layers = len(lengths)
        # each [slots + 2, B, C, kernel] and [slots + 2, B, H, d_k, d_v] float32: the ring, then the scratch and
        # the zero rows a fixed-shape step indexes
        self.conv: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent: list[torch.Tensor | None] = [None] * num_layers
        self.base = [0] * num_layers    # positions settled into the ring; the rows past it are pending
        self.pending: list[list[Row]] = [[] for _ in range(num_layers)]

    def layers(self) -> list[int]:
        return [layer for layer, conv in enumerate(self.conv) if conv is not None]

    def holds(self, layer: int, position: int) -> bool:
        """Whether the states after the row at `position` are still here (pending, or in the ring)."""
        return position < self.lengths[layer] and self.base[layer] - (position + 1) < self.slots

    def after(self, layer: int, position: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The conv window and recurrent state after the row at `position` (Nones before the first row: zeros)."""
        if position < 0 or self.conv[layer] is None:
            return None, None
        base = self.base[layer]
        if position >= base:
            row = self.pending[layer][position - base]
            return row.window, row.state
        if base - (position + 1) >= self.slots:
            raise ValueError(f"a row follows position {position}, but a linear-attention layer keeps its states "
                             f"for the last {self.slots - 1} positions; allocate the cache with a larger rollback")
        slot = (position + 1) % self.slots
        return self.conv[layer][slot], self.recurrent[layer][slot]

    def add(self, layer: int, parents: list[int], windows: list[torch.Tensor], states: list[torch.Tensor]) -> None:
        """A forward's rows, appended at the layer's length, each after the row at its parent's position."""
        if self.conv[layer] is None:
            self.conv[layer] = windows[0].new_zeros(self.slots + 2, *windows[0].shape)
            self.recurrent[layer] = states[0].new_zeros(self.slots + 2, *states[0].shape)
        self.pending[layer].extend(map(Row, parents, windows, states))
        self._settle(layer)

    def _settle(self, layer: int) -> None:
        """Pending rows that continue the ring's chain join it (all of a chain forward's rows at once)."""
        base, pending = self.base[layer], self.pending[layer]
        count = 0
        while count < len(pending) and pending[count].parent == base + count - 1:
            count += 1
        if count:
            kept = pending[max(0, count - self.slots): count]             # only the last `slots` fit
            ring = torch.arange(base + count - len(kept) + 1, base + count + 1,
                                device=kept[0].state.device) % self.slots
            self.conv[layer].index_copy_(0, ring, torch.stack([row.window for row in kept]))
            self.recurrent[layer].index_copy_(0, ring, torch.stack([row.state for row in kept]))
            self.base[layer] = base + count
            del pending[:count]
        self.lengths[layer] = self.base[layer] + len(pending)

    def keep(self, layer: int, start: int, slots: list[int]) -> None:
        """Keep, after the first `start` positions, only the rows at `slots` (ascending), moved down to start,
        start + 1, ...: a draft tree's accepted path or kept subtree."""
        if slots == list(range(start, start + len(slots))):      # nothing moves: the rows keep their parents
            self.set_length(layer, min(self.lengths[layer], start + len(slots)))
            return
        moved = {old: start + i for i, old in enumerate(slots)}
        rows = []
        for old in slots:
            window, state = self.after(layer, old)
            if old >= self.base[layer]:
                parent = self.pending[layer][old - self.base[layer]].parent
            else:       # read from the ring: copied, as the slot it sits in may be rewritten below
                parent, window, state = old - 1, window.clone(), state.clone()
            rows.append(Row(moved.get(parent, parent), window, state))
        self.set_length(layer, start)
        if rows:
            self.pending[layer].extend(rows)
            self._settle(layer)

    def set_length(self, layer: int, length: int) -> None:
        """Forget every row at or past `length`; a settled position can be returned to while the ring holds it."""
        base = self.base[layer]
        if length >= base:
            del self.pending[layer][length - base:]
        else:
            if length > 0 and base - length >= self.slots:
                raise ValueError(f"rolling back {base - length} positions, but a linear-attention layer keeps its "
                                 f"states for the last {self.slots - 1}; allocate the cache with a larger rollback")
            self.base[layer] = length
            self.pending[layer].clear()
        self.lengths[layer] = self.base[layer] + len(self.pending[layer])

    def ring_index(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] (device) -> the ring rows holding the states after them, as tensor ops: slot (p + 1) mod
        slots; the scratch row for the cache's last position (no row follows it: an idle stage writes there); the
        zero row for -1 (before the first token)."""
        ring = (positions + 1) % self.slots
        ring = torch.where(positions >= self.max_length - 1, self.slots, ring)
        return torch.where(positions < 0, self.slots + 1, ring)

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's ring as a fixed-shape step reads and writes it: (conv [slots + 2, B, C, kernel], recurrent
        [slots + 2, B, H, d_k, d_v])."""
        if self.conv[layer] is None:
            raise ValueError("a fixed-shape step continues a prefill: a linear-attention layer has no states yet")
        if self.max_length is None:
            raise ValueError("a fixed-shape step needs a static cache (new_cache(max_length=...))")
        return self.conv[layer], self.recurrent[layer]

    def written(self, layer: int, length: int) -> None:
        """A fixed-shape step wrote the layer's states up to `length` straight into the ring."""
        self.pending[layer].clear()
        self.base[layer] = length
        self.lengths[layer] = length

    def move(self, slots: torch.Tensor, sources: torch.Tensor) -> None:
        """The states after positions `sources` [r] copied to those after `slots` [r] in every layer (device tensors:
        a device step's accepted tree path), read before any is written."""
        if not self.layers():
            return
        to, read = self.ring_index(slots), self.ring_index(sources)
        for layer in self.layers():
            for ring in (self.conv[layer], self.recurrent[layer]):
                ring.index_copy_(0, to, ring.index_select(0, read))
