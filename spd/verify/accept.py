"""The verdict on a cycle's deterministic drafts, as one function of tensors, for every decoder that has them.

A deterministic draft — a module's argmax, a context's token, a tree node's top-W child — is kept exactly when it
equals the target's own choice after its parent (the argmax, or at T > 0 the keyed draw AR makes at that position,
spd.verify.sampling.KeyedDraws) and every draft above it was kept. The verified tokens are then the target's choices
along the deepest kept path: AR's tokens, and at T > 0 AR's samples. The rollback is that path: the rows on it keep
their cache entries, every other row is dropped.

The device steps (spd.runtime.device_step: chains and trees; spd.runtime.device_pipeline: SPD's one draft a step)
run these inside the step; the host's draft-then-verify loop (spd.runtime.sequence) runs the same functions on the
choices it computed. Drafts drawn from a q (a module's sample at T > 0) are settled by rejection sampling instead,
node by node (spd.verify.sampling.settle_children), as the pipelines' verdicts are.
"""

from __future__ import annotations

import torch

from spd.verify.sampling import BLOCK, KeyedDraws, SamplingParams, blocks_of, warp


def kept_drafts(drafts: torch.Tensor, choices: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """A chain's verdict: drafts [k] (draft i follows draft i - 1, the first follows the root), choices [k] (the
    target's token where each draft stands, i.e. after its parent), real [k] (False: padding, never kept) -> the
    drafts kept [], the longest prefix equal to the choices."""
    hit = drafts == choices                                                            # [k]
    if real is not None:
        hit = hit & real
    return torch.cumprod(hit.long(), 0).sum()


def kept_path(tokens: torch.Tensor, chosen: torch.Tensor, real: torch.Tensor, depth: torch.Tensor,
              parent: torch.Tensor, ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree's verdict: tokens [r] (row 0 the root, parents before children), chosen [r] (the target's token after
    each row), real [r] (False: padding), depth [r], parent [r], ancestors [r, r] (row i sees row j: j is i or
    above it) -> (drafts kept [], the deepest kept row [], path [r]: path[d] the kept row at depth d for d <= kept).
    A row is held when every row on its branch below the root is its parent's choice; ties between held rows of the
    same depth cannot happen (siblings carry different tokens), so the deepest held row is the one kept."""
    r = len(tokens)
    rows = torch.arange(r, device=tokens.device)                                       # [r]
    hit = ((tokens == chosen.gather(0, parent)) & real) | (rows == 0)                  # [r]
    held = ~(ancestors & ~hit.view(1, r)).any(-1)                                      # [r] every ancestor hit
    best = torch.where(held, depth, -1).argmax()                                       # []
    kept = depth.gather(0, best.view(1))[0]                                            # []
    on_path = ancestors.gather(0, best.view(1, 1).expand(1, r))[0]                     # [r]
    path = (on_path.view(r, 1) & (depth.view(r, 1) == rows.view(1, r))).long().argmax(0)   # [r]
    return kept, best, path


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """logits [r, V] -> each row's argmax [r], ties to the lowest id (spd.verify.sampling.greedy_token's, row by row).
    A CPU reads block maxima first, as greedy_token does: a whole vocabulary's argmax costs it several times more."""
    r = len(logits)
    blocks = blocks_of(logits)                                                         # [r, V / BLOCK, BLOCK]
    if blocks is None:
        return logits.argmax(-1)
    block = blocks.amax(-1).argmax(-1)                                                 # [r] first block with the max
    inside = blocks.gather(1, block.view(r, 1, 1).expand(r, 1, BLOCK)).view(r, BLOCK).argmax(-1)   # [r]
    return block * BLOCK + inside


def keyed_choices(logits: torch.Tensor, params: SamplingParams, draws: KeyedDraws, positions: list[int],
                  tokens: list[int] | None = None, parents: list[int] | None = None) -> tuple[torch.Tensor, list[float]]:
    """logits [r, V] -> the keyed draw after each row [r] (row i chooses position positions[i]) and the target's p
    of each drawn token (what KeyedDraws records for the positions that are verified). With a tree's `tokens` and
    `parents` (parents first), only the rows the verdict reads are drawn — the root, and a row whose draft is its
    parent's draw — and the others choose -1 (p NaN): on a CPU a draw costs a warp of the whole vocabulary, and most
    rows of a sampled cycle sit below a missed draft."""
    chosen, chances = [-1] * len(logits), [float("nan")] * len(logits)
    for i, (row, position) in enumerate(zip(logits, positions)):
        if tokens is not None and i and chosen[parents[i]] != tokens[i]:
            continue
        chosen[i], chances[i] = draws.draw(warp(row, params), position)
    return torch.tensor(chosen), chances
