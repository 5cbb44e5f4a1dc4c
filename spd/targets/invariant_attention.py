"""Attention whose every row comes out bit for bit the same whatever else shares the forward — so a verification
forward of a chain or a tree computes each row exactly as the one-row AR step at that position does.

Why it is needed: on a CPU in bfloat16 a forward of 16 rows costs about 1.2x one row (float32: 2x), which makes
drafting cheap, but PyTorch's SDPA there does not give a row the same bits in a 1-row call and in an 8-row call, and
bfloat16 rounding carries the difference into the next token within a few hundred positions. The products
(`F.linear`, batched `matmul`) in bfloat16 on a CPU are row-invariant (each output element is the same dot product
however many rows or columns the call has: tests/test_invariant_attention.py checks it on the machine that runs the
tests), and so are row-wise softmax, norms and rotary embeddings. So this kernel builds attention from those alone:

- scores: q K^T as one bfloat16 product (transformers' eager attention does the same), scaled in float32;
- each row's visible keys, in ascending cache slot — a draft tree's ancestors sit in node order, parents before
  children, so this is ascending position: exactly the keys, in the order, of the AR step at that row's position;
- softmax over them in float32 (a longer row padded with -inf gives the same bits: the padding adds exact zeros);
- P V in blocks of `BLOCK` positions counted from the sequence's start, each block one bfloat16 product, the blocks
  summed in order in float32 — so the sum of a row is split the same way whatever length the call has. A block
  whose positions every row holds at the same cache slot (the prefix before a tree) is one product for all rows;
  later blocks gather each row's own values.

Lossless as a consequence, not as an approximation: greedy speculative decoding equals AR token for token, and a
keyed sampled request draws the same tokens, because every logit row is identical (tests). Used for CPU targets in
bfloat16 (`StagedTarget` switches them to it); float32 keeps SDPA.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

KERNEL = "spd_row_invariant"
BLOCK = 64


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a target on this device and dtype should attend with this kernel (CPU bfloat16)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def target_shapes(model: torch.nn.Module) -> tuple[tuple[tuple[int, int], ...], int]:
    """The (in, out) of every Linear of the target and its attention's head size: what `products_invariant` checks."""
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    config = model.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return tuple(sorted(shapes)), head


def same_bits_at_every_row_count(d_in: int, d_out: int, many=lambda x, w: F.linear(x, w), rows: int = 17,
                                  seed: int = 0) -> bool:
    """Whether many(x, w) (x [r, d_in] in bfloat16, w ones [d_out, d_in]) gives each row the same bits for r = 1 as
    for r = 2..rows. The inputs make the order of a sum visible — each row holds large values that cancel, so a
    kernel that adds in another order loses other bits — and the weights are ones, so every output is that one sum."""
    g = torch.Generator().manual_seed(seed)
    w = torch.ones(d_out, d_in, dtype=torch.bfloat16)
    x = torch.randn(rows, d_in, generator=g)
    for r in range(rows):
        idx = torch.randperm(d_in, generator=g)[:8]
        x[r, idx[:4]], x[r, idx[4:]] = 2.0 ** 20, -(2.0 ** 20)
    x = x.to(torch.bfloat16)
    alone = torch.cat([many(x[i: i + 1], w) for i in range(rows)])
    return all(torch.equal(many(x[:m], w), alone[:m]) for m in range(2, rows + 1))


@functools.lru_cache(maxsize=None)
def products_invariant(shapes: tuple[tuple[int, int], ...], head_dim: int, rows: int = 17) -> bool:
    """Whether this CPU's bfloat16 products give a row the same bits in a call of 1 row as of 2..`rows`, for these
    Linear shapes and the kernel's own products (scores over `head_dim`, values over `BLOCK`). oneDNN picks its kernel
    by shape: SmolLM2's products are one kernel at every row count here, a 32-wide one is not."""
    def batched(x, w):                          # the kernel's matmuls: several kv heads at once
        return torch.matmul(x.unsqueeze(0).expand(3, -1, -1), w.T.unsqueeze(0).expand(3, -1, -1))[1]

    check = functools.partial(same_bits_at_every_row_count, rows=rows)
    return all(check(i, o, seed=k) for k, (i, o) in enumerate(shapes)) and \
        check(head_dim, 2 * BLOCK, batched, seed=len(shapes)) and check(BLOCK, head_dim, batched, seed=len(shapes) + 1)


class _Plan:
    """What a forward's mask says, worked out once for all its layers: which slots each row reads, in what order,
    and which blocks of positions every row holds at the same slots."""

    def __init__(self, mask: torch.Tensor | None, b: int, t: int, s: int, g: int, device):
        visible = _visible(mask, b, t, s, device)                               # [B, T, S]
        count = visible.sum(-1)                                                 # [B, T] keys each row sees
        self.blocks = max(1, -(-int(count.max()) // BLOCK))
        self.length = self.blocks * BLOCK
        self.empty = bool((count == 0).any())      # a row that sees nothing (padding) attends to nothing
        slot = torch.arange(s, device=device)
        valid = slot < count.unsqueeze(-1)
        self.gather = self.index = None
        if torch.equal(visible, valid):            # every row sees slots 0..count-1: its keys are in place already
            self.shared = self.blocks
        else:                                      # visible slots first, ascending (a stable sort keeps their order)
            slots = torch.sort((~visible).to(torch.uint8), dim=-1, stable=True).indices          # [B, T, S]
            first_moved = int(torch.where(valid & (slots != slot), slot, s).min())
            self.shared = min(first_moved // BLOCK, self.blocks)
            self.gather = slots.repeat(1, g, 1).unsqueeze(1)                    # [B, 1, gT, S]
            if self.shared < self.blocks:          # each row's own values for the later blocks, in its order
                index = slots[..., self.shared * BLOCK: self.length]
                self.index = F.pad(index, (0, self.length - self.shared * BLOCK - index.shape[-1])).reshape(b, -1)
        self.hide = None if bool(valid.all()) else ~valid.repeat(1, g, 1).unsqueeze(1)          # [B, 1, gT, S]


def _visible(mask: torch.Tensor | None, b: int, t: int, s: int, device) -> torch.Tensor:
    """[B, T, S] bool from a layer's mask: None is a one-row step that sees every key, or a fresh causal pass."""
    if mask is None:
        if t == 1:
            return torch.ones(b, 1, s, dtype=torch.bool, device=device)
        keys = torch.arange(s, device=device).view(1, -1)
        rows = torch.arange(t, device=device).view(-1, 1) + (s - t)          # the rows are the last t of the s keys
        return (keys <= rows).expand(b, t, s)
    if mask.dtype != torch.bool:           # an additive mask: 0 where visible
        mask = mask == 0
    return mask[:, 0].expand(b, t, s)


_last: tuple = (None, None, None)          # (the mask, its shape key, its plan): one forward's layers share a mask


def _plan(mask: torch.Tensor | None, b: int, t: int, s: int, g: int, device) -> _Plan:
    global _last
    key = (b, t, s, g, device, None if mask is None else mask._version)    # a mask written in place: a new one
    held, held_key, plan = _last
    if held_key == key and (held is None if mask is None else held is not None and held() is mask):
        return plan
    plan = _Plan(mask, b, t, s, g, device)
    _last = (None if mask is None else weakref.ref(mask), key, plan)
    return plan


def _positions(value: torch.Tensor, n: int) -> torch.Tensor:
    """value [B, H_kv, S, D]'s first n positions: a view past S into the cache's buffer where it has them (a static
    cache's rows past its length are zeros or earlier rows: finite, and weighed 0), else zero-padded."""
    b, h, s, d = value.shape
    if n <= s:
        return value[:, :, :n]
    stride = value.stride()
    last = value.storage_offset() + (b - 1) * stride[0] + (h - 1) * stride[1] + (n - 1) * stride[2] + d
    if stride[3] == 1 and stride[2] == d and n * d <= stride[1] and last <= value.untyped_storage().nbytes() // \
            value.element_size():
        return value.as_strided((b, h, n, d), stride)
    return F.pad(value, (0, 0, 0, n - s))


def row_invariant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            **kwargs):
    """query [B, H, T, D], key/value [B, H_kv, S, D] (the cache after this forward's rows), attention_mask None or
    [B|1, 1, T, S]. Returns [B, T, H, D] and no weights, as every transformers kernel does."""
    b, h, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = h // hkv
    plan = _plan(attention_mask, b, t, s, g, query.device)
    q = query.reshape(b, hkv, g * t, d)        # a kv head's query heads stacked: row index = head * T + t
    scores = torch.matmul(q, key.transpose(2, 3))                              # [B, Hkv, gT, S]
    if plan.gather is not None:
        scores = scores.gather(-1, plan.gather.expand(b, hkv, g * t, s))
    scores = scores.float().mul_(d ** -0.5 if scaling is None else scaling)
    if plan.hide is not None:
        scores.masked_fill_(plan.hide, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if plan.empty:
        probs = probs.nan_to_num(0.0)
    blocks, shared, length = plan.blocks, plan.shared, plan.length
    weights = probs.new_zeros(b, hkv, g * t, length, dtype=value.dtype)       # [B, Hkv, gT, L]
    weights[..., : min(s, length)] = probs[..., :length]
    parts = []
    if shared:
        v = _positions(value, shared * BLOCK).reshape(b, hkv, shared, BLOCK, d)
        p = weights[..., : shared * BLOCK].view(b, hkv, g * t, shared, BLOCK).transpose(2, 3)
        parts.append(torch.matmul(p, v))                                       # [B, Hkv, shared, gT, D]
    if shared < blocks:
        rest = blocks - shared
        v = torch.stack([value[i].index_select(1, plan.index[i]) for i in range(b)])   # [B, Hkv, T*rest*BLOCK, D]
        v = v.view(b, hkv, t, rest, BLOCK, d)
        p = weights[..., shared * BLOCK:].view(b, hkv, g, t, rest, BLOCK).permute(0, 1, 3, 4, 2, 5)
        out = torch.matmul(p, v)                                               # [B, Hkv, T, rest, g, D]
        parts.append(out.permute(0, 1, 3, 4, 2, 5).reshape(b, hkv, rest, g * t, d))
    # blocks summed in order, in float32: a row's sum is the same whatever blocks (zeros for it) follow
    out = (parts[0] if len(parts) == 1 else torch.cat(parts, 2)).float()
    out = out[:, :, 0] if blocks == 1 else out.cumsum(2)[:, :, -1]           # [B, Hkv, gT, D]
    return out.reshape(b, h, t, d).transpose(1, 2).to(query.dtype), None


AttentionInterface.register(KERNEL, row_invariant_attention)
AttentionMaskInterface.register(KERNEL, sdpa_mask)       # transformers' own forward builds SDPA's boolean masks
