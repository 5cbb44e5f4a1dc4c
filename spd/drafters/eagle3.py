"""EAGLE-3's drafter for chain decoding (`spd.runtime.chain`): m drafts in a row, then one target forward.

The draft model keeps one K/V row per verified position i, made from (embedding of x_{i+1}, f_i) with the
target's fused features f_i (the training-time test's step 0). The first draft comes from the last such row;
draft j >= 1 is a temporary row at the next position made from (embedding of draft j, the previous row's own
output), as in the test's step j. After verification the temporary rows are dropped and the verified positions
get their step-0 rows from the target's features of the verify pass.

W > 1 grows EAGLE-2's dynamic tree (design §8): the root's W best children, then for each further depth the
frontier's rows in one pass (each under its own ancestors), W children per frontier node, the W best of them by
cumulative log-probability as the next frontier; finally the `budget` best nodes of all, parents first. Children
are the top-W of q (`spd.verify.sampling.children_of_rows`, the pipeline's rule too), deterministic, so verification keeps each with its p (`spd.verify.sampling.settle_children`).
"""

from __future__ import annotations

import torch

from spd.models.attention import attend_block
from spd.drafters.base import CHAIN, TREES, Cycle, Drafter
from spd.models.eagle3 import Eagle3Module
from spd.verify.sampling import Proposal, children_of_rows
from spd.targets.kv_cache import LayerKVCache
from spd.verify.tree import DraftTree


class Eagle3Drafter(Drafter):
    capabilities = frozenset({CHAIN, TREES})

    def __init__(self, module: Eagle3Module, embed):
        self.module = module
        self.embed = embed    # token ids [1, S] -> H^0 [1, S, d] (the target's own embedding)

    def layers_needed(self, bounds: list[int] | None = None) -> list[int]:
        """Target layers read (bounds: unused; no pipeline)."""
        return self.module.layers_needed()

    def start(self, prompt_hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """prompt_hidden: {layer: H^layer [1, P, d]}; tokens: the prompt and the first generated token (P + 1)."""
        self.kv = LayerKVCache(1)
        self.rows = 0          # verified positions with a step-0 row
        self.last_h = None     # [1, 1, d] output of the newest step-0 row (it drafts the first token)
        self.observe(prompt_hidden, tokens)

    def _run(self, embedding: torch.Tensor, h: torch.Tensor, start: int, positions: torch.Tensor | None = None,
             visible: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (embedding, h) [1, S, d] at positions start.. attend to the cache and causally to each other (or at
        `positions` [S], to the cached rows `visible` [S, cached + S] allows: a tree's ancestors); their K/V join
        the cache. Returns the layer's outputs [1, S, d]."""
        m = self.module
        if positions is None:
            positions = torch.arange(start, start + h.shape[1], device=h.device)
        cos, sin = m.rope(positions.view(1, -1), h)
        q, k, v, gate = m.project(embedding, h, cos, sin)
        keys, values = self.kv.update(k, v, 0)
        s, total = h.shape[1], keys.shape[2]
        if visible is None:
            visible = torch.arange(total, device=h.device).view(1, -1) <= \
                (total - s + torch.arange(s, device=h.device)).view(-1, 1)
        none = k.new_zeros(*k.shape[:3], 0, k.shape[-1])
        out = m.finish(h, attend_block(q, keys, values, visible.unsqueeze(0), none, none, None,
                                       m.layer.self_attn.scaling), gate)
        return out

    @torch.no_grad()
    def observe(self, hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """Positions rows.. are verified: hidden {layer: [1, S, d]} holds their target states (S of them) and
        `tokens` the whole verified sequence (one longer: each row also reads the token after it)."""
        start = self.rows
        self.kv.crop(start)                                  # drop the drafts' temporary rows
        count = next(iter(hidden.values())).shape[1]
        ids = torch.tensor([tokens[start + 1: start + 1 + count]], device=hidden[0].device)
        out = self._run(self.embed(ids), self.module.fuse(hidden), start)
        self.rows += count
        self.last_h = out[:, -1:]

    def rewind(self, rows: int) -> None:
        """Forget every verified position from `rows` on (cost calibration re-times one update)."""
        self.kv.crop(rows)
        self.rows = rows

    @torch.no_grad()
    def chain(self, m: int, propose) -> list[Proposal]:
        """The chain (W = 1): m drafts for the positions after the verified sequence; propose(logits [V_target]) -> Proposal (the
        argmax, or a sample with the q it was drawn from)."""
        drafts, h = [], self.last_h
        for j in range(m):
            if j:
                ids = torch.tensor([[drafts[-1].token]], device=h.device)
                h = self._run(self.embed(ids), h, self.rows - 1 + j)
            drafts.append(propose(self.module.target_logits(self.module.logits(h)[0, -1])))
        self.kv.crop(self.rows)
        return drafts

    def _log_q(self, h: torch.Tensor) -> torch.Tensor:
        """log q over the target's vocabulary [S, V] for the rows h [1, S, d]."""
        return torch.log_softmax(self._logits(h).float(), -1)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The module's logits over the target's vocabulary [S, V] for the rows h [1, S, d]."""
        return self.module.target_logits(self.module.logits(h)[0])

    @torch.no_grad()
    def propose(self, cycle: Cycle, propose) -> DraftTree:
        root, m, width, budget = cycle.root, cycle.m, cycle.width, cycle.budget
        if width == 1:
            return DraftTree.chain(root, self.chain(m, propose))
        # candidates: (cumulative log q, parent candidate or -1 for the root, token, depth)
        cands: list[tuple[float, int, int, int]] = []
        frontier = []
        for proposal, lp in children_of_rows(self._logits(self.last_h)[-1:], width)[0]:
            cands.append((lp, -1, proposal.token, 1))
            frontier.append(len(cands) - 1)
        out_of = {-1: self.last_h}        # candidate -> its row's output [1, 1, d] (what its children are drafted from)
        slot: dict[int, int] = {}         # candidate -> its temporary row, counted after the verified rows
        for depth in range(2, m + 1):
            base, temp, count = self.rows, len(slot), len(frontier)
            visible = torch.zeros(count, base + temp + count, dtype=torch.bool)
            visible[:, :base] = True
            for i, c in enumerate(frontier):
                visible[i, base + temp + i] = True
                a = cands[c][1]
                while a != -1:
                    visible[i, base + slot[a]] = True
                    a = cands[a][1]
            ids = torch.tensor([[cands[c][2] for c in frontier]], device=self.last_h.device)
            h = torch.cat([out_of[cands[c][1]] for c in frontier], 1)
            positions = torch.full((count,), base - 2 + depth, device=h.device)   # depth - 1 nodes, as in draft()
            out = self._run(self.embed(ids), h, 0, positions, visible.to(h.device))
            for i, c in enumerate(frontier):
                slot[c], out_of[c] = temp + i, out[:, i: i + 1]
            grown = []
            for c, children in zip(frontier, children_of_rows(self._logits(out), width)):
                for proposal, lp in children:
                    cands.append((cands[c][0] + lp, c, proposal.token, depth))
                    grown.append(len(cands) - 1)
            frontier = sorted(grown, key=lambda c: (-cands[c][0], c))[:width]
        self.kv.crop(self.rows)
        # the budget best by cumulative log q; a node whose parent missed the cut stays out (ties), so the
        # kept nodes are closed under ancestors
        chosen: set[int] = set()
        for c in sorted(range(len(cands)), key=lambda c: (-cands[c][0], cands[c][3], c)):
            if len(chosen) == budget:
                break
            if cands[c][1] == -1 or cands[c][1] in chosen:
                chosen.add(c)
        tree, node_of = DraftTree(root), {-1: 0}
        for c in sorted(chosen, key=lambda c: (cands[c][3], -cands[c][0], c)):
            node_of[c] = tree.add(node_of[cands[c][1]], Proposal(cands[c][2]))
        return tree


def chain_drafter(*, module: Eagle3Module, embed) -> Eagle3Drafter:
    """EAGLE-3's drafter (spd.methods): its module, fed the target's embedding of each drafted token."""
    return Eagle3Drafter(module, embed)
