"""Drafts priced by the machine (torch-free): how many rows a verification forward should carry, chosen each cycle
from what the rows cost here and how likely each drafted node is to be kept.

- `RowCosts`: seconds of one target forward of r rows (r = 1: the plain AR step), measured on this machine
  (spd.targets.row_costs). On a CPU the curve is not monotone — a multiple of 4 rows can cost less than 2 or 3 —
  so each cycle prices every row count, filling it with the best candidates.
- `AcceptancePredictor`: P(a node is kept | its parent was), per bucket of the drafter's own evidence (its source,
  the length of the context match behind it, the share of earlier continuations that agree, how many there were,
  its depth), counted online from the run's own verdicts over a prior from the evidence, scaled by the request's
  calibration (kept over expected, pooled over each source's buckets, per bin of the target's top-2 margin at the
  newest verified token, and of the candidate's recall). Verdicts are whatever verification decided — greedy or
  sampled — so at T = 1 it learns the sampled acceptance; the drafter judges every candidate, drafted or not, so a
  bucket priced out can win back. A sampled request's context candidates carry their recall — the target's p of the
  token where the context that proposes it occurred before (spd.verify.sampling.KeyedDraws.chance) — which a bucket's
  average cannot tell apart: a token the target was sure of there against one it drew by luck.
- `given_noise`: at T = 1 with keyed draws, a candidate's chance given the noise that will choose its position.
- `choose`: the prefix of the candidates (best first, parents before children) that maximises expected tokens per
  second, 1 + sum of the kept nodes' reach probabilities over the forward's cost, where a draft must beat the plain
  step by an edge.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Evidence:
    """What a drafter knows about one candidate node when it proposes it."""
    source: str          # "suffix", "lookup", ...
    match: int           # tokens of the context suffix whose earlier occurrences proposed it
    share: float         # of the continuations that reached its parent, the weight that continued with it
    support: float       # the weight (occurrences) that reached its parent
    depth: int           # 1 = a child of the root
    margin: float = float("inf")   # the target's top-2 logit margin at the newest verified token (inf: unknown)
    recall: float = float("nan")   # sampled: the target's p of it where the context proposing it had it (NaN: unknown)


MARGIN_EDGES = (1.0, 3.0, 6.0)     # logits: a near tie, unsure, sure, very sure
RECALL_EDGES = (0.05, 0.2, 0.5, 0.8)


def _bin(value: float, edges: tuple[float, ...]) -> int:
    """How many of the (ascending) edges lie at or below value (none for NaN)."""
    return bisect_right(edges, value) if value == value else 0


@dataclass
class AcceptancePredictor:
    """Kept / proposed counts per bucket of evidence. A bucket's estimate starts from the drafter's own share, shrunk
    by `prior_scale` and by the request's calibration — kept over expected across every bucket of its source, so one
    run learns within a few cycles whether its text repeats (and a corpus's continuations, kept far less often than
    the context's own, do not talk the context down) — with `prior_weight` pseudo-observations, and moves to what the
    bucket's own verdicts say."""
    prior_weight: float = 2.0
    prior_scale: float = 0.8
    pool_weight: float = 4.0                           # pseudo-observations behind a calibration of 1
    per_source: bool = True                            # False: one calibration for every source (SourcePricer)
    recall_weight: float = 0.3                         # of a long match's prior, the part its recall decides
    counts: dict = field(default_factory=dict)        # bucket -> [kept, proposed]
    pooled: dict = field(default_factory=dict)        # (source, margin, recall bins) -> [kept, expected by the priors]

    @classmethod
    def for_sampling(cls) -> "AcceptancePredictor":
        """For a sampled request (T > 0), where a candidate is kept with the target's p of it rather than when it is
        the argmax: a lower prior that the buckets' few verdicts move less. The greedy settings over-predicted the
        sampled verdicts of the buckets they priced high by 20-40% (the datastore's children 25-60%) and
        under-predicted those they priced low 2-4x (experiments/noise_calibration.py); replaying one recording of every
        judged candidate through each setting (experiments/prior_replay.py; the same candidates, not new decodes), prior_weight 16 and
        prior_scale 0.6 fit 10 everyday answers' verdicts best (log-likelihood -0.340 against -0.365) and the 30
        held-out MT-Bench answers' too (-0.295 against -0.317). Not the default (an A/B by the
        clock): +0.7% by the clock at T = 1 on the eval set, while where drafts are kept often its heavy prior
        learns so slowly that short requests draft little (docs/speed-cpu.md, "What was tried and did not pay")."""
        return cls(prior_weight=16.0, prior_scale=0.6)

    @staticmethod
    def bucket(e: Evidence) -> tuple:
        return (e.source, _bin(e.match, (2, 3, 4, 6, 9)), _bin(e.share, (0.25, 0.5, 0.75, 0.999)),
                _bin(e.support, (2, 4, 8)), _bin(e.depth, (2, 4)))

    def _pool(self, e: Evidence) -> tuple:
        recall = -1 if e.recall != e.recall else _bin(e.recall, RECALL_EDGES)
        return (e.source if self.per_source else None, _bin(e.margin, MARGIN_EDGES), recall)

    def calibration(self, e: Evidence) -> float:
        kept, expected = self.pooled.get(self._pool(e), (0.0, 0.0))
        return (kept + self.pool_weight) / (expected + self.pool_weight)

    def prior(self, e: Evidence) -> float:
        """What the drafter's evidence alone says: its share, less for a short match (a one-token match's
        continuations agree with the target about half as often as a long one's), shrunk by `prior_scale`. Where
        the target's p of the token at the occurrences is known (a sampled request's own answer), `recall_weight`
        of it — as much more as the match is long, where the earlier context is more nearly this one — stands in
        for the share."""
        fit = 1.0 - 0.5 ** e.match
        prior = e.share * fit
        if e.recall == e.recall:
            lean = self.recall_weight * fit
            prior = (1.0 - lean) * prior + lean * e.recall
        return self.prior_scale * prior

    def predict(self, e: Evidence) -> float:
        kept, proposed = self.counts.get(self.bucket(e), (0.0, 0.0))
        prior = min(1.0, self.prior(e) * self.calibration(e))
        return (kept + self.prior_weight * prior) / (proposed + self.prior_weight)

    def observe(self, e: Evidence, kept: bool) -> None:
        entry = self.counts.setdefault(self.bucket(e), [0.0, 0.0])
        entry[0] += kept
        entry[1] += 1
        pooled = self.pooled.setdefault(self._pool(e), [0.0, 0.0])
        pooled[0] += kept
        pooled[1] += self.prior(e)


NOISE_SHARE = 0.35   # of a candidate's chance at T = 1, the part its own noise decides (the rest stays the predictor's)


def given_noise(chance: float, u: float, share: float = NOISE_SHARE) -> float:
    """A deterministic candidate's chance of being the keyed draw (spd.verify.sampling.KeyedDraws) once its own uniform u
    at its position is known. For a token of probability p under the target the draw is x iff log p + g(x) beats
    the rest of the vocabulary, whose best score is a Gumbel at log(1 - p): P = u ** ((1 - p) / p). But `chance` is
    the predictor's — a bucket's average over candidates whose p runs from ~0 to ~1 — and the formula at the average
    is far sharper than the average of the formula: over the default's sampled everyday answers the candidates it
    put under 2% were kept ~35x more often than that, those it put over 40% ~0.6x as often — a worse fit
    (log-likelihood -0.584 a verdict) than ignoring the noise (-0.383). So only `share` of the chance follows the
    noise: (1 - share) * chance + share * u ** ((1 - p) / p), best at 0.3-0.4 (-0.365; experiments/noise_calibration.py,
    docs/speed-cpu.md, "How good the pricing is"; a probe over eval answers agreed). Over u it averages back to
    `chance` at any share; share = 1 is the formula alone."""
    p = min(max(chance, 1e-6), 1.0 - 1e-9)
    return (1.0 - share) * chance + share * u ** ((1.0 - p) / p)


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


def choose(reach: list[float], costs: RowCosts, edge: float = 0.0) -> int:
    """How many of the candidates (reach[i]: the probability that candidate i is kept; best first, parents before
    children) one forward carries: the row count r maximising (1 + sum(reach[:r - 1])) / seconds(r), so a row
    count that costs less than a smaller one is filled with the next-best candidates. A draft must beat the plain
    step's rate by `edge` (0.1: 10%) — the estimates that win a comparison are the optimistic ones, and a machine's
    costs move. 0: a plain AR step."""
    best_rows, best_rate, gained = 1, (1.0 + edge) / costs.seconds[0], 1.0
    for rows in range(2, min(len(reach) + 1, costs.max_rows) + 1):
        gained += reach[rows - 2]
        rate = gained / costs.seconds[rows - 1]
        if rate > best_rate:
            best_rows, best_rate = rows, rate
    return best_rows - 1


def choose_beside(reach: list[float], costs: RowCosts, edge: float = 0.0, side: tuple[int, ...] = (0,),
                  value: float = 0.0) -> tuple[int, int, float]:
    """`choose` with rows that keep no token this cycle offered beside the candidates (Self-Draft's branches,
    spd.drafters.suffix_branches): option u adds side[u] rows (side[0] = 0: none; ascending), each worth `value`
    tokens (what such a row is predicted to earn later), so the forward of r candidate rows and option u is worth
    (1 + sum(reach[:r - 1]) + value * side[u]) / seconds(r + side[u]). Returns (candidates carried, option, its
    predicted tokens a second); rows past the measured curve are not offered. The plain step, edge and all, is the
    rate to beat, as in `choose`."""
    best, best_rate = (0, 0), (1.0 + edge) / costs.seconds[0]
    for u, extra in enumerate(side):
        gained = 1.0 + value * extra
        for rows in range(1, min(len(reach) + 1, costs.max_rows - extra) + 1):
            if rows > 1:
                gained += reach[rows - 2]
            if rows == 1 and extra == 0:
                continue                  # the plain step: best_rate's start
            rate = gained / costs.seconds[rows + extra - 1]
            if rate > best_rate:
                best, best_rate = (rows - 1, u), rate
    return best[0], best[1], best_rate


class SourcePricer:
    """Inside SPD's pipeline each step drafts one token, from the context (a lookup match) or from the module; both
    fill the one row the step carries anyway, so the price is only the chance of being kept: the context drafts
    where its match's predicted acceptance is at least the module's. Both are learned from this request's verdicts,
    as the pipeline reports them: a drafted position that leaves the last stage was kept (`finalize`), the first
    position a rollback discards was rejected, the later ones were drafted on a rejected token and judge nothing."""

    # before any verdict: a two-token match (prior 0.6) wins over the module (0.4), the unpriced rule
    MODULE = Evidence("module", 1, 1.0, 1.0, 1)

    def __init__(self):
        # one calibration for both sources: only drafted positions are judged here, so a source calibrated on its own
        # verdicts alone could be priced out before it had any (the text's repetitiveness lifts the lookup's prior)
        self.predictor = AcceptancePredictor(per_source=False)
        self.pending: dict[int, Evidence] = {}        # drafted position -> its evidence, until its verdict

    @staticmethod
    def lookup(match: int) -> Evidence:
        return Evidence("lookup", match, 1.0, 1.0, 1)

    def prefers_lookup(self, match: int) -> bool:
        return self.predictor.predict(self.lookup(match)) >= self.predictor.predict(self.MODULE)

    def drafted(self, pos: int, match: int | None) -> None:
        """Position `pos` was drafted by the lookup after a match of `match` tokens (None: by the module)."""
        self.pending[pos] = self.MODULE if match is None else self.lookup(match)

    def finalize(self, pos: int) -> None:
        evidence = self.pending.pop(pos, None)
        if evidence is not None:
            self.predictor.observe(evidence, True)

    def rollback(self, length: int) -> None:
        evidence = self.pending.pop(length, None)
        if evidence is not None:
            self.predictor.observe(evidence, False)
        for pos in [pos for pos in self.pending if pos > length]:
            del self.pending[pos]
