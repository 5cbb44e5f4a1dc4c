"""Per-layer KV cache with in-place appends and O(1) truncation (rollback).

The HF attention modules only call `update(k, v, layer_idx)` on whatever `past_key_values` they get, so this
class plugs into the target's own decoder layers without forking any modelling code.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """Preallocated K/V buffers, one pair per target layer, each with its own length (stages fill at different times)."""

    def __init__(self, num_layers: int, initial_capacity: int = 256):
        self.num_layers = num_layers
        self._capacity = initial_capacity
        self._keys: list[torch.Tensor | None] = [None] * num_layers  # each [B, H_kv, capacity, head_dim]
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    def _grow(self, layer: int, needed: int) -> None:
        old_k, old_v = self._keys[layer], self._values[layer]
        cap = max(needed, 2 * old_k.shape[2])
        new_k = old_k.new_empty(*old_k.shape[:2], cap, old_k.shape[3])
        new_v = old_v.new_empty(*old_v.shape[:2], cap, old_v.shape[3])
        length = self.lengths[layer]
        new_k[:, :, :length] = old_k[:, :, :length]
        new_v[:, :, :length] = old_v[:, :, :length]
        self._keys[layer], self._values[layer] = new_k, new_v

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append key/value [B, H_kv, T, head_dim] and return all cached K/V of the layer (views, no copy)."""
        if self._keys[layer_idx] is None:
            b, h, _, d = key.shape
            self._keys[layer_idx] = key.new_empty(b, h, max(self._capacity, key.shape[2]), d)
            self._values[layer_idx] = value.new_empty(b, h, max(self._capacity, key.shape[2]), value.shape[3])
        start = self.lengths[layer_idx]
        end = start + key.shape[2]
        if end > self._keys[layer_idx].shape[2]:
            self._grow(layer_idx, end)
        self._keys[layer_idx][:, :, start:end] = key
        self._values[layer_idx][:, :, start:end] = value
        self.lengths[layer_idx] = end
        return self._keys[layer_idx][:, :, :end], self._values[layer_idx][:, :, :end]

    def view(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached K/V of a layer, [B, H_kv, length, head_dim] each (views)."""
        end = self.lengths[layer_idx]
        return self._keys[layer_idx][:, :, :end], self._values[layer_idx][:, :, :end]

    def crop(self, length: int) -> None:
        """Forget every position >= length in every layer (rollback to the verified prefix)."""
        self.lengths = [min(cur, length) for cur in self.lengths]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]
