"""Starting points for the speculation module's attention (docs/training.md, "Why depth did not help").

Trained from a random start, the module's attention stays flat: at a = 1 every head puts about 1/(t+1) of its
mass on each memory row (experiments/depth_diagnosis.py, `attention_by_lag_a1`), so the module reads a bag of the
context and never singles out row t-1, whose full-depth state is what EAGLE's first draft is built on. A head can
only prefer a *position* through RoPE, and RoPE can only do that when the query and key carry a component that is
the same for every token. Standardised features through FCs have none; `init_previous_token_head` gives every
FC_k a bias along one direction u and builds head 0 so that its scores depend on that component alone, peaking
at lag 1 from the first step. Training is free to move every weight afterwards.
"""

from __future__ import annotations

import torch

from spd.models.module import SpeculationModule


@torch.no_grad()
def quiet_direction(head_weight: torch.Tensor) -> torch.Tensor:
    """The unit vector [d] the head reads least (smallest right-singular vector): a bias along it barely moves
    the draft's logits."""
    _, _, vh = torch.linalg.svd(head_weight.float(), full_matrices=False)
    return vh[-1]


@torch.no_grad()
def init_previous_token_head(module: SpeculationModule, offset: float = 6.0, sharpness: float = 5.0,
                             pairs: int = 6) -> None:
    """Make query head 0 of the first layer attend to the row at lag 1 (its KV head too, shared under GQA).

    offset: the size of u's coordinate in every row after the layer's input norm (rows stay mostly content);
    sharpness: the score of lag 1 per RoPE pair used, in logits, before the neighbours' share is subtracted;
    pairs: how many of the highest RoPE frequencies carry the pattern (low ones cannot tell lag 1 from lag 2).
    """
    first = next(iter(module.fc.values()))
    if first.bias is None:
        raise ValueError("init_previous_token_head needs fc_bias=True (the position needs a constant component)")
    u = quiet_direction(module.head.weight).to(first.weight.dtype)      # [d]
    d = u.numel()
    offset = min(offset, 0.5 * d ** 0.5)   # u's coordinate may not take over a narrow row (tiny test models)
    for fc in module.fc.values():
        fc.weight.sub_(torch.outer(u, u @ fc.weight))           # the content part of every row is orthogonal to u
        content_rms = float(fc.weight.norm() / d ** 0.5)          # per coordinate, for inputs of unit variance
        # after the input norm u's coordinate is offset / rms(row) with rms(row)^2 = content^2 + bias^2 / d
        bias = offset * content_rms / (1 - offset ** 2 / d) ** 0.5
        fc.bias.copy_(bias * u)
    layer = module.layers[0]
    attn = layer.self_attn
    hd = attn.head_dim
    pairs = min(pairs, hd // 2)
    theta = module.rotary.inv_freq.to(u.dtype)[:pairs]          # the highest frequencies, radians per position
    # score(t, s) = scaling * offset^2 * sum_j a^2 cos((s - t + 1) theta_j): the key is the query's pattern
    # turned by one position, so the sum peaks at s = t - 1
    a = (sharpness / (attn.scaling * offset ** 2)) ** 0.5
    q_pattern = torch.zeros(hd, dtype=u.dtype, device=u.device)
    k_pattern = torch.zeros(hd, dtype=u.dtype, device=u.device)
    q_pattern[:pairs] = a
    k_pattern[:pairs] = a * torch.cos(theta)
    k_pattern[hd // 2: hd // 2 + pairs] = a * torch.sin(theta)
    gamma = layer.input_layernorm.weight.to(u.dtype)
    read = u / gamma                                             # undo the norm's per-coordinate weight
    attn.q_proj.weight[:hd].copy_(torch.outer(q_pattern, read))
    attn.k_proj.weight[:hd].copy_(torch.outer(k_pattern, read))
