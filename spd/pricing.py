"""Drafts priced by the machine (torch-free): how many rows a verification forward should carry, chosen each cycle
from what the rows cost here and how likely each drafted node is to be kept.

- `RowCosts`: seconds of one target forward of r rows (r = 1: the plain AR step), measured on this machine
  (spd.targets.row_costs). On a CPU the curve is not monotone — a multiple of 4 rows can cost less than 2 or 3 —
  so each cycle prices every row count, filling it with the best candidates.
- `AcceptancePredictor`: P(a node is kept | its parent was), per bucket of the drafter's own evidence (its source,
  the length of the context match behind it, the share of earlier continuations that agree, how many there were,
  its depth), counted online from the run's own verdicts over a prior the drafter's evidence sets. Verdicts are
  whatever verification decided — greedy or sampled — so at T = 1 it learns the sampled acceptance.
- `choose`: the prefix of the candidates (best first, parents before children) that maximises expected tokens per
  second, 1 + sum of the kept nodes' reach probabilities over the forward's cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Evidence:
    """What a drafter knows about one candidate node when it proposes it."""
    source: str          # "suffix", "lookup", ...
    match: int           # tokens of the context suffix whose earlier occurrences proposed it
    share: float         # of the continuations that reached its parent, the weight that continued with it
    support: float       # the weight (occurrences) that reached its parent
    depth: int           # 1 = a child of the root


def _bin(value: float, edges: tuple[float, ...]) -> int:
    return sum(value >= edge for edge in edges)


@dataclass
class AcceptancePredictor:
    """Kept / proposed counts per bucket of evidence; a bucket's estimate starts at the drafter's own share (shrunk
    by `prior_scale`) with `prior_weight` pseudo-observations, and moves to what this run's verdicts say."""
    prior_weight: float = 2.0
    prior_scale: float = 0.8
    counts: dict = field(default_factory=dict)        # bucket -> [kept, proposed]

    @staticmethod
    def bucket(e: Evidence) -> tuple:
        return (e.source, _bin(e.match, (2, 3, 4, 6, 9)), _bin(e.share, (0.25, 0.5, 0.75, 0.999)),
                _bin(e.support, (2, 4, 8)), _bin(e.depth, (2, 4)))

    def predict(self, e: Evidence) -> float:
        kept, proposed = self.counts.get(self.bucket(e), (0.0, 0.0))
        return (kept + self.prior_weight * self.prior_scale * e.share) / (proposed + self.prior_weight)

    def observe(self, e: Evidence, kept: bool) -> None:
        entry = self.counts.setdefault(self.bucket(e), [0.0, 0.0])
        entry[0] += kept
        entry[1] += 1


@dataclass(frozen=True)
class RowCosts:
    """seconds[r - 1]: one target forward of r rows (the root and r - 1 drafts)."""
    seconds: tuple[float, ...]

    @classmethod
    def flat(cls, rows: int) -> "RowCosts":
        """Every row count costs the same (a machine where the rows are free, or a test's fixed profile)."""
        return cls(tuple(1.0 for _ in range(rows)))

    @property
    def max_rows(self) -> int:
        return len(self.seconds)


def choose(reach: list[float], costs: RowCosts) -> int:
    """How many of the candidates (reach[i]: the probability that candidate i is kept; best first, parents before
    children) one forward carries: the row count r maximising (1 + sum(reach[:r - 1])) / seconds(r), so a row
    count that costs less than a smaller one is filled with the next-best candidates. 0: a plain AR step."""
    best_rows, best_rate, gained = 1, 1.0 / costs.seconds[0], 1.0
    for rows in range(2, min(len(reach) + 1, costs.max_rows) + 1):
        gained += reach[rows - 2]
        rate = gained / costs.seconds[rows - 1]
        if rate > best_rate:
            best_rows, best_rate = rows, rate
    return best_rows - 1
