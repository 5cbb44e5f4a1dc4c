"""Module-layer math shared by training and decoding: memory rows are fixed K/V sources, queries are updated.

A speculation-module layer sees two kinds of keys for each query row:
- *shared* keys, visible to many queries under a boolean mask (training: the depth-n block; decoding: every
  memory row of the step), and
- *own* keys, one small set per query (its own row first, then — in training — the staircase rows
  t-1..t-(n-1) of depths 1..n-1).
Memory rows never pass through the layers: at every layer their K/V come from their raw feature, so a
decoding step only needs to run the query row. Training and decoding both go through `layer_forward`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half convention of the Llama/Qwen3/Gemma3/Qwen3.5 families). x [B, H, S, hd], cos/sin
    [B, S, r]: the first r dims of each head rotate (Qwen3.5 rotates a quarter of them), the rest pass."""
    if cos.shape[-1] < x.shape[-1]:
        turned = cos.shape[-1]
        return torch.cat([rotate(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _heads(proj: nn.Linear, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, S, d] -> [B, H, S, head_dim]."""
    b, s, _ = x.shape
    return proj(x).view(b, s, -1, head_dim).transpose(1, 2)


def queries(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, H, S, hd] of rows x [B, S, d_in], and for a gated attention (Qwen3.5: q_proj gives each head its
    query and an output gate side by side) the gate [B, S, H * hd] the attention's output is multiplied by through
    a sigmoid; None for the other families."""
    b, s, _ = x.shape
    out = attn.q_proj(x)
    heads = attn.config.num_attention_heads
    if out.shape[-1] != 2 * heads * attn.head_dim:
        return out.view(b, s, -1, attn.head_dim).transpose(1, 2), None
    q, gate = out.view(b, s, heads, 2 * attn.head_dim).chunk(2, dim=-1)
    return q.transpose(1, 2), gate.reshape(b, s, -1)


def project_kv(layer: nn.Module, x_normed: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, H_kv, S, hd] of already-normed rows x_normed [B, S, d] at the positions cos/sin encode."""
    attn = layer.self_attn
    k = _heads(attn.k_proj, x_normed, attn.head_dim)
    v = _heads(attn.v_proj, x_normed, attn.head_dim)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    return rotate(k, cos, sin), v


def memory_kv(layer: nn.Module, rows: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of memory rows [B, S, d] from their raw features (the layer's input norm, then its projections)."""
    return project_kv(layer, layer.input_layernorm(rows), cos, sin)


QUERY_CHUNK = 256  # training queries per attention chunk: peak memory O(chunk x N), linear in N


def attend(
    q: torch.Tensor,              # [B, H, Q, hd]
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    shared_mask: torch.Tensor | None,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    own_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """`attend_block` over query chunks; under autograd each chunk is recomputed in backward instead of
    keeping its Q x S attention map, so training memory grows linearly with sequence length."""
    n_q = q.shape[2]
    if n_q <= QUERY_CHUNK:
        return attend_block(q, shared_k, shared_v, shared_mask, own_k, own_v, own_mask, scaling)
    outs = []
    for lo in range(0, n_q, QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, n_q)
        args = (q[:, :, lo:hi], shared_k, shared_v, None if shared_mask is None else shared_mask[:, lo:hi],
                own_k[:, :, lo:hi], own_v[:, :, lo:hi], None if own_mask is None else own_mask[:, lo:hi])
        if torch.is_grad_enabled():
            outs.append(checkpoint(attend_block, *args, scaling, use_reentrant=False))
        else:
            outs.append(attend_block(*args, scaling))
    return torch.cat(outs, dim=2)


def attend_block(
    q: torch.Tensor,              # [B, H, Q, hd]
    shared_k: torch.Tensor,       # [B, H_kv, S, hd]
    shared_v: torch.Tensor,       # [B, H_kv, S, hd]
    shared_mask: torch.Tensor | None,  # [B, Q, S] bool, True = visible; None = all visible
    own_k: torch.Tensor,          # [B, H_kv, Q, P, hd]
    own_v: torch.Tensor,          # [B, H_kv, Q, P, hd]
    own_mask: torch.Tensor | None,  # [B, Q, P] bool
    scaling: float,
) -> torch.Tensor:
    """Softmax over [shared keys | own keys] per query; the map is Q x (S + P), never (S+P) x (S+P)."""
    b, h, nq, hd = q.shape
    h_kv = shared_k.shape[1]
    qg = q.view(b, h_kv, h // h_kv, nq, hd)
    s_shared = torch.einsum("bkgqd,bksd->bkgqs", qg, shared_k) * scaling
    s_own = torch.einsum("bkgqd,bkqpd->bkgqp", qg, own_k) * scaling
    if shared_mask is not None:
        s_shared = s_shared.masked_fill(~shared_mask[:, None, None], float("-inf"))
    if own_mask is not None:
        s_own = s_own.masked_fill(~own_mask[:, None, None], float("-inf"))
    probs = torch.softmax(torch.cat([s_shared, s_own], dim=-1).float(), dim=-1).to(q.dtype)
    n_shared = shared_k.shape[2]
    out = torch.einsum("bkgqs,bksd->bkgqd", probs[..., :n_shared], shared_v)
    out = out + torch.einsum("bkgqp,bkqpd->bkgqd", probs[..., n_shared:], own_v)
    return out.reshape(b, h, nq, hd)


def layer_forward(
    layer: nn.Module,
    hidden: torch.Tensor,         # [B, Q, d] query rows entering the layer
    cos: torch.Tensor,            # [B, Q, hd] RoPE at the query positions
    sin: torch.Tensor,
    shared_k: torch.Tensor,       # [B, H_kv, S, hd] memory K/V of this layer
    shared_v: torch.Tensor,
    shared_mask: torch.Tensor | None,
    extra_k: torch.Tensor | None = None,   # [B, H_kv, Q, P', hd] per-query memory keys (training staircase)
    extra_v: torch.Tensor | None = None,
    extra_mask: torch.Tensor | None = None,  # [B, Q, P'] bool
) -> torch.Tensor:
    """One decoder layer of the target's family with memory-row attention. Returns [B, Q, d]."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    q, gate = queries(attn, x)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = rotate(q, cos, sin)
    k_self, v_self = project_kv(layer, x, cos, sin)
    own_k, own_v = k_self.unsqueeze(3), v_self.unsqueeze(3)  # [B, H_kv, Q, 1, hd]
    own_mask = None
    if extra_k is not None:
        own_k = torch.cat([own_k, extra_k], dim=3)
        own_v = torch.cat([own_v, extra_v], dim=3)
        own_mask = torch.cat([torch.ones_like(extra_mask[..., :1]), extra_mask], dim=-1)
    return layer_output(layer, hidden, attend(q, shared_k, shared_v, shared_mask, own_k, own_v, own_mask,
                                              attn.scaling), gate)


def layer_output(layer: nn.Module, hidden: torch.Tensor, attended: torch.Tensor,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
    """The rest of a decoder layer after attention: output gate (Qwen3.5), output projection, residual, MLP (Gemma's
    sandwich norms too). hidden [B, Q, d] is the layer's residual input, attended [B, H, Q, hd], gate [B, Q, H * hd]
    or None. Returns [B, Q, d]."""
    b, _, nq, _ = attended.shape
    attended = attended.transpose(1, 2).reshape(b, nq, -1)
    if gate is not None:
        attended = attended * torch.sigmoid(gate)
    out = layer.self_attn.o_proj(attended)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: sandwich norms around attention and MLP
        hidden = hidden + layer.post_attention_layernorm(out)
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    hidden = hidden + out
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
