"""The context's statistics with EAGLE-3's children beside them (`method=eagle3 draft_source=suffix+module`), priced
per cycle as method=suffix is (spd.pricing).

Context statistics know the text's repeats and nothing else; EAGLE-3's module knows the target's next-token
distribution, roughly, at the price of a pass through one decoder layer and a head. Each cycle the statistics'
candidates come first; EAGLE-3 adds the root's `width` likeliest children (those the statistics did not already
propose) and, `depth` > 1, the likeliest children under its own first choice, one more pass a level. Every candidate
carries its evidence — the statistics' share, or EAGLE-3's q — so the one predictor learns, per source, how often
each is kept in this request (greedy or sampled: a deterministic child is kept with the target's p of it), and the
row-cost pricing drafts the prefix of all candidates that pays. `gate`: EAGLE-3 is not consulted where the
statistics' best first draft is already predicted kept at least this often (its passes cost time).

The module keeps one K/V row per verified position either way (spd.drafters.eagle3); only its drafting passes are
saved where the gate holds. Every drafted node is a point mass (q = None), so verification keeps the target's
output and its distribution (spd.verify.sampling.settle_children).
"""

from __future__ import annotations

import math

import torch

from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.suffix import Retrieval, SuffixDrafter, _Node
from spd.methods import SUFFIX_MODULE
from spd.pricing import Evidence, RowCosts
from spd.verify.sampling import children_of_rows
from spd.spec import LookupOptions

EAGLE3 = "eagle3"


class SuffixEagle3Drafter(SuffixDrafter):
    def __init__(self, eagle: Eagle3Drafter, costs: RowCosts | None = None, max_n: int = 8, width: int = 4,
                 depth: int = 1, gate: float = 1.0, retrieval: Retrieval | None = None):
        super().__init__(1, max_n, costs, retrieval=retrieval)
        self.eagle, self.eagle_width, self.eagle_depth, self.gate = eagle, width, depth, gate
        self.consulted = 0           # cycles EAGLE-3 drafted children in

    def layers_needed(self, bounds=None) -> list[int]:
        return self.eagle.layers_needed(bounds)

    def start(self, prompt_hidden, tokens) -> None:
        super().start(prompt_hidden, tokens)
        self.eagle.start(prompt_hidden, tokens)

    def observe(self, hidden, tokens) -> None:
        super().observe(hidden, tokens)
        self.eagle.observe(hidden, tokens)

    def rewind(self, rows: int) -> None:
        self.eagle.rewind(rows)

    def candidates(self, m: int, width: int, budget: int) -> tuple[list[_Node], list[Evidence]]:
        nodes, evidence = super().candidates(m, width, budget)
        best = max((self.predictor.predict(e) for node, e in zip(nodes, evidence) if node.parent == -1), default=0.0)
        if best >= self.gate:
            return nodes, evidence
        self.consulted += 1
        eagle = self.eagle
        parent, h = -1, eagle.last_h
        for level in range(1, min(self.eagle_depth, m) + 1):
            children = children_of_rows(eagle._logits(h)[-1:], self.eagle_width)[0]
            taken = {node.token for node in nodes if node.parent == parent}
            for proposal, log_q in children:
                if proposal.token not in taken:
                    nodes.append(_Node(proposal.token, parent, level))
                    # match 9: the predictor's longest-match bin, so its prior is ~0.8 q (spd.pricing)
                    evidence.append(Evidence(EAGLE3, 9, math.exp(log_q), 1.0, level, self.margin))
            if level == min(self.eagle_depth, m) or not children:
                break
            first = children[0][0].token                 # its own likeliest child, one level deeper
            parent = next(i for i, node in enumerate(nodes) if node.parent == parent and node.token == first)
            ids = torch.tensor([[first]], device=h.device)
            h = eagle._run(eagle.embed(ids), h, eagle.rows - 1 + level)
        eagle.kv.crop(eagle.rows)
        return nodes, evidence


def chain_drafter(*, module, embed, draft_source: str, lookup: LookupOptions, row_costs: RowCosts | None,
                  retrieval: Retrieval | None) -> Eagle3Drafter | SuffixEagle3Drafter:
    """EAGLE-3's drafter (spd.methods): its module alone, or beside the context's statistics
    (draft_source=suffix+module, matching up to lookup_max_ngram tokens)."""
    if draft_source == SUFFIX_MODULE:
        return SuffixEagle3Drafter(Eagle3Drafter(module, embed), row_costs, lookup.max_ngram, retrieval=retrieval)
    return Eagle3Drafter(module, embed)
