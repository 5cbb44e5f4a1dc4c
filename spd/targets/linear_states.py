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
    def __init__(self, lengths: list[int], rollback: int = ROLLBACK):
        self.lengths = lengths          # the owning cache's per-layer lengths (shared, updated in place)
        self.slots = rollback + 1
        num_layers = len(lengths)
        self.conv: list[torch.Tensor | None] = [None] * num_layers        # each [slots, B, C, kernel]
        self.recurrent: list[torch.Tensor | None] = [None] * num_layers   # each [slots, B, H, d_k, d_v] float32
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
            self.conv[layer] = windows[0].new_zeros(self.slots, *windows[0].shape)
            self.recurrent[layer] = states[0].new_zeros(self.slots, *states[0].shape)
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

    def refuse(self, what: str) -> None:
        if self.layers():
            raise ValueError(f"cannot {what} in a linear-attention layer (its state follows one path of tokens)")
