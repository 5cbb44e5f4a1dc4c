"""Per-layer KV cache with in-place appends, O(1) truncation (rollback) and compaction to kept rows (trees).

The HF attention modules only call `update(k, v, layer_idx)` on whatever cache (`cache=`) they get, so this
class plugs into the target's own decoder layers without forking any modelling code.

With `max_length` (what decoding passes: prompt + new tokens + the tokens a pipeline or chain holds in flight) the
cache is static: each layer's buffers are allocated once, zeroed, at that length the first time the layer is
written (so a stage allocates only its own layers), never grow, and a crop only changes a length. A fixed-shape
step (`spd.targets.fixed_step`, what a CUDA graph captures) sets `write_at`, a position tensor: writes then land at
those positions and every read returns the whole buffer, whose rows past a query's position its mask hides.

A hybrid target's linear-attention layers (Qwen3.5's Gated DeltaNet) carry a conv state and a recurrent state that
have absorbed every token they saw, so they cannot be truncated: the cache keeps each such layer's states *as of*
the last `rollback` positions in a preallocated ring (`spd.targets.linear_states`), and a rollback reads the state
of the position it returns to; `spd.targets.gated_delta` runs those layers' rows against the ring. A fixed-shape
step's linear rows read their parents' states (`parent_at`, or the position before) and write their own at
`write_at`, in the ring.
"""

from __future__ import annotations

import torch

from spd.targets.linear_states import ROLLBACK, Group, LinearStates


class LayerKVCache:
    """Preallocated K/V buffers, one pair per target layer, each with its own length (stages fill at different times)."""

    def __init__(self, num_layers: int, initial_capacity: int = 256, max_length: int | None = None,
                 rollback: int = ROLLBACK):
        self.num_layers = num_layers
        self.max_length = max_length
        self._capacity = max_length or initial_capacity
        self._keys: list[torch.Tensor | None] = [None] * num_layers  # each [B, H_kv, capacity, head_dim]
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers
        self.write_at: torch.Tensor | None = None   # [T] positions of a fixed-shape step's rows
        # [T] the positions of those rows' parents where they are a tree (default: the position before each)
        self.parent_at: torch.Tensor | None = None
        self.linear = LinearStates(self.lengths, rollback, max_length)   # a hybrid's linear layers (none for
                                                                         # attention-only)

    @property
    def static(self) -> bool:
        return self.max_length is not None

    def _grow(self, layer: int, needed: int) -> None:
        if self.static:
            raise ValueError(f"{needed} positions exceed the static KV cache's max_length={self.max_length}; "
                             "decode fewer tokens or allocate a longer cache")
        old_k, old_v = self._keys[layer], self._values[layer]
        cap = max(needed, 2 * old_k.shape[2])
        # zeroed like a static cache's: rows past the length may be read with weight 0 (spd.targets.invariant_attention)
        new_k = old_k.new_zeros(*old_k.shape[:2], cap, old_k.shape[3])
        new_v = old_v.new_zeros(*old_v.shape[:2], cap, old_v.shape[3])
        length = self.lengths[layer]
        new_k[:, :, :length] = old_k[:, :, :length]
        new_v[:, :, :length] = old_v[:, :, :length]
        self._keys[layer], self._values[layer] = new_k, new_v

    def _buffers(self, layer_idx: int, shape: tuple[int, int, int, int], like: torch.Tensor,
                 value_dim: int | None = None) -> None:
        if self._keys[layer_idx] is None:
            b, h, t, d = shape
            # zeroed: a fixed-shape step's mask hides unwritten rows, but NaN garbage would survive a mask
            self._keys[layer_idx] = like.new_zeros(b, h, max(self._capacity, t), d)
            self._values[layer_idx] = like.new_zeros(b, h, max(self._capacity, t), value_dim or d)

    def reserve(self, layer_idx: int, shape: tuple[int, int, int, int], like: torch.Tensor,
                value_dim: int | None = None):
        """Room for `shape[2]` rows appended to the layer (written by the caller): its whole buffers [B, H_kv,
        capacity, head_dim] and where the rows go. What `update` does but the copy, for a caller that writes the
        rows itself (spd.targets.lean_layers' C++ layers)."""
        self._buffers(layer_idx, shape, like, value_dim)
        start = self.lengths[layer_idx]
        end = start + shape[2]
        if end > self._keys[layer_idx].shape[2]:
            self._grow(layer_idx, end)
        self.lengths[layer_idx] = end
        return self._keys[layer_idx], self._values[layer_idx], start

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append key/value [B, H_kv, T, head_dim] and return all cached K/V of the layer (views, no copy)."""
        if self.write_at is not None:
            self._buffers(layer_idx, tuple(key.shape), key, value.shape[3])
            self._keys[layer_idx].index_copy_(2, self.write_at, key)
            self._values[layer_idx].index_copy_(2, self.write_at, value)
            return self._keys[layer_idx], self._values[layer_idx]
        keys, values, start = self.reserve(layer_idx, tuple(key.shape), key, value.shape[3])
        end = start + key.shape[2]
        keys[:, :, start:end] = key
        values[:, :, start:end] = value
        return keys[:, :, :end], values[:, :, :end]

    def view(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached K/V of a layer, [B, H_kv, length, head_dim] each (views)."""
        end = self.lengths[layer_idx]
        return self._keys[layer_idx][:, :, :end], self._values[layer_idx][:, :, :end]

    def crop(self, length: int) -> None:
        """Forget every position >= length in every layer (rollback to the verified prefix)."""
        for layer, cur in enumerate(self.lengths):
            self._set_length(layer, min(cur, length))

    def written(self, layers: range, length: int) -> None:
        """A fixed-shape step wrote `layers` up to `length`: what an eager step after it appends after."""
        for layer in layers:
            if self.linear.conv[layer] is not None:
                self.linear.written(layer, length)
            else:
                self.lengths[layer] = length

    def _set_length(self, layer: int, length: int) -> None:
        if self.linear.conv[layer] is not None:
            self.linear.set_length(layer, length)     # a linear layer returns only to a position it kept
        else:
            self.lengths[layer] = length

    def keep(self, start: int, slots: list[int], layers: range | None = None) -> None:
        """Keep, after the first `start` rows, only the rows at `slots` (ascending, each >= start), moved down to
        start, start + 1, ...: a draft tree's accepted path or kept subtree. Its keys were rotated at the positions
        they keep, so nothing is re-rotated. layers: only these (one pipeline stage's; default all)."""
        count = len(slots)
        layers = range(self.num_layers) if layers is None else layers
        for layer in self.linear.layers():
            if layer in layers:            # a tree's path picks its rows' states
                self.linear.keep(layer, start, slots)
        layers = [layer for layer in layers if self.linear.conv[layer] is None]
        if slots == list(range(start, start + count)):
            for layer in layers:           # a chain's path: nothing moves
                self.lengths[layer] = min(self.lengths[layer], start + count)
            return
        index = None   # one host-to-device copy per keep, not per layer
        for layer in layers:
            keys = self._keys[layer]
            if keys is None or self.lengths[layer] <= start:
                continue
            if index is None:
                index = torch.tensor(slots, device=keys.device)
            keys[:, :, start: start + count] = keys.index_select(2, index)
            values = self._values[layer]
            values[:, :, start: start + count] = values.index_select(2, index)
            self.lengths[layer] = start + count

    def move(self, slots: torch.Tensor, sources: torch.Tensor) -> None:
        """Every layer's rows at `sources` [r] copied to `slots` [r] (device tensors: no value read back), read
        before any is written: a device step's accepted tree path moved down to contiguous slots."""
        self.linear.move(slots, sources)
        for keys, values in zip(self._keys, self._values):
            if keys is not None:
                keys.index_copy_(2, slots, keys.index_select(2, sources))
                values.index_copy_(2, slots, values.index_select(2, sources))

    def linear_groups(self, rows: int, parents: list[int] | None):
        """A linear-attention layer's rows of a forward and the states they run against: all of them, this cache's
        (spd.targets.gated_delta)."""
        return [Group(self.linear, parents, 0, rows)]

    def holds(self, layer: int, slot: int) -> bool:
        """Whether `memory(layer, slot)` can answer: every written row of an attention layer; a linear layer's last
        `rollback` positions and its pending rows."""
        if self.linear.conv[layer] is not None:
            return self.linear.holds(layer, slot)
        return slot < self.lengths[layer]

    def memory(self, layer: int, slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer holds of position `slot` (default its last): an attention layer's key and value rows there
        [B, H_kv, head_dim]; a linear-attention layer's conv window and recurrent state after it, which carry every
        row before it too. What a rollback must leave as a fresh prefill of the same tokens would."""
        slot = self.lengths[layer] - 1 if slot is None else slot
        if self.linear.conv[layer] is not None:
            return self.linear.after(layer, slot)
        return self._keys[layer][:, :, slot], self._values[layer][:, :, slot]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]
