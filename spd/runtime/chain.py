"""Draft-then-verify decoding (EAGLE-3's chain and dynamic tree, design §2 and §8; the context lookup): the drafter
proposes a chain of up to m tokens (W = 1) or a tree (W > 1), the whole target checks every node in one forward
(a tree under its ancestor mask, each node at prefix + depth), the longest verified path is kept, and the target's
own token at the first miss (or after the path's last node) comes free. No pipeline: the target runs unsplit. A
drafter with nothing to propose makes the cycle a plain AR step.

The verdict and its statistics are one request's `ChainSequence` (spd.runtime.sequence), shared with the batched
decoder. Deterministic drafts (the lookup's, the context statistics', EAGLE-3's argmax and top-W children) are kept
along the deepest path whose every draft is the target's own choice after its parent — its argmax, or at T > 0 AR's
keyed draw there (spd.verify.accept, the device step's rule), so a node's children are each kept with exactly their
p. Drafts sampled from a q (EAGLE-3's chain at T > 0) keep x ~ q with probability min(1, p(x)/q(x)) and otherwise
draw from norm(max(0, p - q)) (spd.verify.sampling.settle_children) — so the output is the target's own distribution
at every W.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from spd.decoding import Decoder, Request
from spd.drafters.base import TREES, Drafter
from spd.runtime.sequence import ChainSequence
from spd.targets import ragged
from spd.targets.ragged import few_rows_products
from spd.targets.row_costs import use_machine_products
from spd.targets.stages import StagedTarget
from spd.verify.tree import DraftTree


class ChainDecoder(Decoder):
    def __init__(self, target: StagedTarget, drafter: Drafter, eos_ids: frozenset[int], m: int,
                 width: int = 1, budget: int | None = None):
        """width: children per node (W; 1 = a chain); budget: drafted nodes per cycle (None: m, a chain's)."""
        if m < 1:
            raise ValueError(f"m={m} draft tokens per cycle must be >= 1")
        if width < 1 or (width > 1 and not drafter.has(TREES)):
            raise ValueError(f"W={width}: {type(drafter).__name__} drafts chains only (W = 1)")
        self.target, self.drafter, self.eos_ids, self.m = target, drafter, eos_ids, m
        self.width, self.budget = width, budget or m
        self.capture = frozenset(drafter.layers_needed())
        use_machine_products(target)    # a verification forward's few rows, multiplied the faster way here

    def forward_tree(self, tree: DraftTree, cache, fed: int, rows=None):
        """The target over every node of the tree (the root at position `fed`): (logits [T, V], captured). rows:
        a drafter's side rows (SIDE_ROWS' side_rows: tokens, offsets, visible among themselves), run after the
        tree's nodes in the same forward: each sees the cache, the root and what `visible` lets it; no tree node
        sees them. Then logits are [T + R, V] (the settle hands rows T.. back to the drafter and keeps only the
        accepted path's cache rows, so theirs never stay)."""
        tokens = tree.tokens()
        if rows is not None:
            tokens = tokens + list(rows[0])
        ids = torch.tensor([tokens], device=self.target.device)
        # swapping F.linear costs a Python call per product: only for a row count the machine multiplies weight-first
        with few_rows_products() if len(ids[0]) in ragged.FEW_ROWS else nullcontext():
            if rows is not None:
                offsets, visible = side_rows_mask(tree, rows)
                out, captured = self.target.forward_all(ids, cache, fed, self.capture, offsets=offsets,
                                                        visible=visible)
            elif tree.is_chain():     # contiguous positions, causal: the plain path, bit for bit
                out, captured = self.target.forward_all(ids, cache, fed, self.capture)
            else:
                out, captured = self.target.forward_all(ids, cache, fed, self.capture,
                                                        offsets=torch.tensor(tree.depths()), visible=tree.visibility())
            return self.target.logits(out[0]), captured

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        seq = ChainSequence(self.target, self.drafter, self.eos_ids, prompt_ids, request, self.m, self.width,
                            self.budget)
        self.stats = seq.stats
        yield from seq.prefill()
        while not seq.done:
            tree = seq.draft()
            logits, captured = self.forward_tree(tree, seq.cache, seq.fed, seq.rows)
            yield from seq.settle(logits, captured)       # the cycle's state is settled before its tokens go out


def side_rows_mask(tree: DraftTree, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """offsets [T + R] and visible [T + R, T + R] of a tree (T nodes, under its ancestor mask) followed by a
    drafter's R side rows: a side row sees the root (node 0) and the side rows its own `visible` row names; no tree
    node sees a side row, no side row sees a drafted node."""
    _, side_offsets, side_visible = rows
    t, r = len(tree), len(side_offsets)
    visible = torch.zeros(t + r, t + r, dtype=torch.bool)
    visible[:t, :t] = tree.visibility()
    visible[t:, 0] = True
    visible[t:, t:] = torch.as_tensor(side_visible, dtype=torch.bool)
    offsets = torch.tensor(tree.depths() + list(side_offsets))
    return offsets, visible
