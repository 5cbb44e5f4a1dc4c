"""A hybrid target's Gated DeltaNet layer (Qwen3.5) run so that a row's bits never depend on how many
rows share its forward, and so that each row can follow its own path through a draft tree.

transformers' layer runs a chunked algorithm over many rows and a recurrent one over a single row, and even its
elementwise steps (softplus, sigmoid, SiLU over a few heads) take a CPU's scalar or vector path by the tensor's
size: a verify forward over k rows and AR's one-row step would part in their last bits. Here the projections run
batched over the rows (the suite's row-invariant products), and everything between them — the causal
convolution's window, the normalisations, the gates and the delta-rule update of the recurrent state — runs one
row at a time, at the one-row shapes AR uses. A row starts from the state after its parent: the row before it in
a chain, the node it hangs from in a tree (`parents`), or the cache's state for the first row.

The layer's class is swapped (`rowwise`), as the suite's product kernels swap a Linear's: its weights, its decoder
layer and the model's code stay transformers'. A forward without the suite's cache (a training batch's teacher
pass, transformers' own generate) runs transformers' own forward, chunked and fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spd.targets.linear_states import Group


PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def rowwise(model: torch.nn.Module) -> int:
    """Swap every Gated DeltaNet of `model` for the row-at-a-time one; returns how many were swapped. A layer with
    other parts (Qwen3-Next fuses its projections differently) is refused."""
    count = 0
    for module in model.modules():
        base = type(module)
        if base.__name__.endswith("GatedDeltaNet") and not isinstance(module, RowwiseMixin):
            missing = [part for part in PARTS if not hasattr(module, part)]
            if missing:
                raise ValueError(f"{base.__name__} has no {', '.join(missing)}: the suite runs Qwen3.5's Gated "
                                 "DeltaNet layers (Qwen3-Next's are not supported)")
            module.__class__ = _rowwise_class(base)
            count += 1
    return count


_CLASSES: dict[type, type] = {}


def _rowwise_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Rowwise{base.__name__}", (RowwiseMixin, base), {})
    return _CLASSES[base]


def parents_of(visible: torch.Tensor, rows: int) -> list[int]:
    """visible [T, S] (which cached rows each new row sees; the new rows are its last T columns) -> each row's
    parent, the nearest earlier row it sees, as a cache position (-1: none): a draft tree's structure, whose nodes
    follow their parents in the cache."""
    seen = visible.tolist()
    first = visible.shape[1] - rows
    return [max((j for j in range(first + i) if seen[i][j]), default=-1) for i in range(rows)]


class RowwiseMixin:
    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        """hidden_states [B, T, d] -> [B, T, d] against the states `cache.linear_groups` names: one sequence's
        cache (a LayerKVCache), or each sequence of a ragged forward its own (spd.targets.ragged).
        kwargs["parents"]: each row's parent's cache position, a draft tree's structure; default a chain."""
        if cache is None or not hasattr(cache, "linear_groups"):
            # no cache: a training batch (teacher features need no bitwise match with a decode, and transformers'
            # chunked algorithm is many times faster over long rows); another cache: transformers' own generate
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask)
        if getattr(cache, "write_at", None) is not None:      # a fixed-shape step: positions as tensors
            parents = cache.parent_at if cache.parent_at is not None else cache.write_at - 1
            return step_fixed(self, hidden_states, cache.linear, cache.write_at, parents)
        return step_rows(self, hidden_states, cache.linear_groups(hidden_states.shape[1], kwargs.get("parents")))


def _project(layer, hidden: torch.Tensor):
    """The projections over every row at once: the convolution's inputs [B, T, C], the output gate [B, T, value_dim],
    the write strength's and the decay's inputs [B, T, H_v] each."""
    return layer.in_proj_qkv(hidden), layer.in_proj_z(hidden), layer.in_proj_b(hidden), layer.in_proj_a(hidden)


def step_rows(layer, hidden: torch.Tensor, groups: list[Group]) -> torch.Tensor:
    """hidden [B, T, d] -> [B, T, d]: the projections over every row at once, then each group's rows one at a time
    from its own states."""
    batch = hidden.shape[0]
    mixed, gate, beta_in, decay_in = _project(layer, hidden)
    weight = layer.conv1d.weight.squeeze(1)                 # [C, kernel]
    idx = layer.layer_idx
    zeros = (mixed.new_zeros(batch, mixed.shape[-1], layer.conv_kernel_size),
             mixed.new_zeros(batch, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype=torch.float32))
    outs = []
    for states, parents, lo, hi in groups:
        first = states.lengths[idx]                         # the cache position of the group's first row
        if parents is None:
            parents = list(range(first - 1, first + hi - lo - 1))
        windows, recurrents = [], []
        for row, parent in zip(range(lo, hi), parents):
            if parent >= first:                             # a row of this forward
                before = windows[parent - first], recurrents[parent - first]
            else:
                before = states.after(idx, parent)
            window_before, state_before = zeros if before[0] is None else before
            window = torch.cat([window_before[:, :, 1:], mixed[:, row].unsqueeze(-1)], dim=-1)   # [B, C, kernel]
            out, state = _one_row(layer, window, weight, state_before, gate[:, row], beta_in[:, row],
                                  decay_in[:, row])
            windows.append(window)
            recurrents.append(state)
            outs.append(out)
        states.add(idx, parents, windows, recurrents)
    return layer.out_proj(torch.stack(outs, dim=1))         # [B, T, d]


def step_fixed(layer, hidden: torch.Tensor, states, write_at: torch.Tensor, parent_at: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, d] -> [B, T, d] with fixed shapes and no value read back: row i starts from the states after
    position parent_at[i] and leaves its own after write_at[i], both in the ring (spd.targets.linear_states), one row
    after another so that a row can follow one of this forward's. The same arithmetic as step_rows, row for row."""
    mixed, gate, beta_in, decay_in = _project(layer, hidden)
    weight = layer.conv1d.weight.squeeze(1)                 # [C, kernel]
    conv, recurrent = states.rows(layer.layer_idx)          # [slots + 2, B, C, kernel], [slots + 2, B, H_v, d_k, d_v]
    write, read = states.ring_index(write_at), states.ring_index(parent_at)     # [T], [T]
    outs = []
    for row in range(hidden.shape[1]):
        window_before = conv.index_select(0, read[row: row + 1])[0]                           # [B, C, kernel]
        state_before = recurrent.index_select(0, read[row: row + 1])[0]                       # [B, H_v, d_k, d_v]
        window = torch.cat([window_before[:, :, 1:], mixed[:, row].unsqueeze(-1)], dim=-1)
        out, state = _one_row(layer, window, weight, state_before, gate[:, row], beta_in[:, row], decay_in[:, row])
        conv.index_copy_(0, write[row: row + 1], window.unsqueeze(0))
        recurrent.index_copy_(0, write[row: row + 1], state.unsqueeze(0))
        outs.append(out)
    return layer.out_proj(torch.stack(outs, dim=1))         # [B, T, d]


def _one_row(layer, window, weight, state, gate, beta_in, decay_in):
    """One token through the convolution, the delta rule and the gated norm; every shape is a one-row shape.
    window [B, C, kernel]; state [B, H_v, d_k, d_v] float32; gate [B, value_dim]; beta_in, decay_in [B, H_v]."""
    batch = window.shape[0]
    conv = F.silu((window * weight).sum(-1))                                 # [B, C]
    query, key, value = torch.split(conv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, -1, layer.head_k_dim).float()              # [B, H_k, d_k]
    key = key.reshape(batch, -1, layer.head_k_dim).float()
    value = value.reshape(batch, -1, layer.head_v_dim).float()              # [B, H_v, d_v]
    if layer.num_v_heads != layer.num_k_heads:                             # each key head serves several value heads
        query = query.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
        key = key.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6) * layer.head_k_dim ** -0.5
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    beta = beta_in.float().sigmoid()                                        # [B, H_v]: how much this token writes
    decay = (-layer.A_log.float().exp() * F.softplus(decay_in.float() + layer.dt_bias)).exp()   # [B, H_v]
    state = state * decay[..., None, None]
    remembered = (state * key.unsqueeze(-1)).sum(-2)                        # [B, H_v, d_v]: what the state recalls
    delta = (value - remembered) * beta.unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)                 # [B, H_v, d_k, d_v]
    read = (state * query.unsqueeze(-1)).sum(-2).to(window.dtype)           # [B, H_v, d_v]
    normed = layer.norm(read.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
    return normed.reshape(batch, layer.value_dim), state
