"""Self-Draft's branches as a priced source of the context statistics (`method=suffix suffix_branches=true`).

Multi-Branch Self-Drafting (spd.drafters.selfdraft) runs N draft branches of up to L tokens beside every verification
forward; each branch row is the target's guess of what follows the context and the branch's earlier tokens, and every
window of G - 1 branch tokens with the next row's guess is a contextual n-gram. Here those n-grams are one more source
of method=suffix's candidates, beside the context, the datastore and the memory: the n-grams keyed by the newest
verified token merge into a trie (each continuation weighted by how often the branches produced it) under first tokens
no other source proposed, and are priced and calibrated apart, as source "branches" (spd.pricing).

The branch rows keep no token in the cycle that runs them; what they are worth comes later, as candidates. So each
cycle's pricing offers whole branches (least recently run first) beside the candidates at `row_value` tokens a row
(spd.pricing.choose_beside): the rows ride only where the machine's row costs and that value say the forward's
expected tokens a second go up. `row_value` is learned per request: the tokens the branch candidates added to each
cycle's predicted best forward (its predicted rate with them less without them, times its cost), summed over the
request, over the branch rows run, with `prior_value` over `prior_rows` pseudo-rows to start from — on a machine where
rows cost little the branches keep running, where they cost a share of a forward they run until their n-grams show
they pay, and a cache left from earlier rows keeps earning (and raising the value) while they rest.

Lossless: a branch row sees the verified cache, the root and its own branch's earlier rows, no drafted node sees it,
its K/V never stays (the settle keeps the accepted path's rows, which come before it), its prediction is an argmax
that draws no noise, and every candidate is deterministic (q = None). A decoder that runs no side rows (the batched
one, the device step) leaves the branches idle: the first cycle whose rows did not run turns them off for that decoder.
"""

from __future__ import annotations

import itertools

import torch

from spd.drafters.base import SIDE_ROWS
from spd.drafters.selfdraft import DraftBranches
from spd.drafters.suffix import SuffixDrafter, _best_first, _Node
from spd.pricing import Evidence, choose_beside

BRANCHES = "branches"     # the source of the candidates the draft branches' n-grams proposed
PRIOR_VALUE = 0.1         # tokens a branch row is worth before the request has shown anything
PRIOR_ROWS = 36.0         # ... held as firmly as that many rows' worth of evidence (one N = L = 6 forward's)


class SuffixBranchesDrafter(SuffixDrafter):
    capabilities = SuffixDrafter.capabilities | {SIDE_ROWS}

    def __init__(self, lanes: DraftBranches, *args, prior_value: float = PRIOR_VALUE, prior_rows: float = PRIOR_ROWS,
                 **options):
        """lanes: the branches and their n-gram cache; the rest as SuffixDrafter takes them."""
        super().__init__(*args, **options)
        self.lanes, self.prior_value, self.prior_rows = lanes, prior_value, prior_rows
        self.extra_rows = lanes.n * lanes.length
        self.runs_side_rows = True       # False once a decoder ran none of a cycle's branch rows
        self.order: list[int] = []       # the branches, least recently run first
        self.plan: list[int] = []        # the branches this cycle's forward runs
        self.pending = False             # branch rows asked for and not yet handed back
        self.gained = self.rows = 0.0    # the request's value evidence: tokens the branch candidates added, rows run
        self.branch_cycles = self.branch_rows = 0   # over every request: cycles that ran branch rows, and the rows

    def start(self, prompt_hidden, tokens) -> None:
        super().start(prompt_hidden, tokens)
        self.lanes.start_branches(list(tokens))
        self.order, self.plan, self.pending = list(range(self.lanes.n)), [], False
        if self.memory is None:         # as the predictor: each request judged on its own
            self.gained = self.rows = 0.0

    def row_value(self) -> float:
        """Tokens a branch row is predicted to earn: the request's evidence over the prior."""
        return (self.gained + self.prior_value * self.prior_rows) / (self.rows + self.prior_rows)

    def candidates(self, m: int, width: int, budget: int):
        nodes, evidence = super().candidates(m, width, budget)
        cached = self.lanes.cached(self.index.tokens[-1])
        if cached:
            first = {node.token for node in nodes if node.parent < 0}
            more, more_evidence = _best_first([(list(cont[:m]), float(count), ()) for cont, count in cached], width,
                                              budget, Evidence(BRANCHES, 1, 0.0, 0.0, 0, self.margin), skip=first)
            offset = len(nodes)
            nodes += [_Node(node.token, node.parent + offset if node.parent >= 0 else -1, node.depth, node.weight)
                      for node in more]
            evidence += more_evidence
        return nodes, evidence

    def carried(self, reach: list[float], sources: list[str]) -> int:
        self.plan = []
        if not (self.lanes.n and self.runs_side_rows):
            return super().carried(reach, sources)
        if self.costs is None:           # unpriced: every branch every cycle, as Self-Draft runs them
            self.plan = list(range(self.lanes.n))
        else:
            # what the branch candidates add to this cycle's best forward, in tokens at its cost (no edge: the
            # plain step is what they compete with)
            take, _, with_them = choose_beside(reach, self.costs)
            _, _, without = choose_beside([r for r, s in zip(reach, sources) if s != BRANCHES], self.costs)
            self.gained += max(0.0, with_them - without) * self.costs.seconds[take]
            sizes = tuple(itertools.accumulate((len(self.lanes.branch[i]) for i in self.order), initial=0))
            carried, units, _ = choose_beside(reach, self.costs, self.edge, sizes, self.row_value())
            self.plan = self.order[:units]
            self.order = self.order[units:] + self.plan
            reach = reach[:carried]
        self.pending = bool(self.plan)
        return len(reach)

    def side_rows(self):
        return self.lanes.branch_rows(self.plan) if self.plan else None

    def side_logits(self, logits: torch.Tensor) -> None:
        self.lanes.branch_logits(logits, self.plan)
        self.pending = False
        self.rows += logits.shape[0]
        self.branch_cycles += 1
        self.branch_rows += logits.shape[0]

    def observe(self, hidden, tokens) -> None:
        if self.pending:                 # the decoder ran the tree alone: it runs no side rows
            self.runs_side_rows = self.pending = False
        super().observe(hidden, tokens)
