"""Metric definitions, written once (design §3).

N = generated tokens (the one sampled from the prefill logits included); K = pipeline steps;
alpha = N / K; equivalent acceptance length eal = n * N / K (= SPD's theoretical speedup, paper Eq. 4).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def count_source(sources: dict[str, list[int]], source: str, accepted: bool) -> None:
    counts = sources.setdefault(source, [0, 0])
    counts[0] += 1
    counts[1] += accepted


@dataclass
class DecodeStats:
    n: int
    N: int = 0
    K: int = 0
    rollbacks: int = 0
    accepted_runs: list[int] = field(default_factory=list)  # consecutive accepted drafts between rollbacks
    # draft source -> [drafts verified, accepted] (only drafts that reached verification; flushed ones are not)
    sources: dict[str, list[int]] = field(default_factory=dict)
    # (index of the verified token among the generated ones, draft source, accepted) per verification, in order:
    # where acceptance falls in the output (experiments/repetition.py); not part of as_dict
    verdicts: list[tuple[int, str, bool]] = field(default_factory=list)
    # steps by the rows each stage ran in them ("r1,...,rn" -> steps): what prices a step whose rows vary
    # (FlowSpec's segments, PipeDec's levels; spd.eval.calibrate.calibrate_rows)
    step_rows: Counter = field(default_factory=Counter)
    restarts: int = 0        # kept children with no branch left in flight: the pipeline refilled from them
    _run: int = 0

    def ran(self, rows: list[int]) -> None:
        """One step's rows per stage (0: idle)."""
        self.step_rows[",".join(map(str, rows))] += 1

    @property
    def stage_rows(self) -> list[int]:
        """Rows each stage ran, summed over steps (a tree level: W)."""
        totals: list[int] = []
        for key, steps in self.step_rows.items():
            rows = [int(r) * steps for r in key.split(",")]
            totals = [a + b for a, b in zip(totals, rows)] if totals else rows
        return totals

    def settle(self, accepted: bool, source: str = "module") -> None:
        """Record the verification of one drafted position (accepted, or corrected with a rollback)."""
        self.verdicts.append((self.N, source, accepted))
        self.N += 1
        count_source(self.sources, source, accepted)
        if accepted:
            self._run += 1
        else:
            self.rollbacks += 1
            self.accepted_runs.append(self._run)
            self._run = 0

    def finish(self) -> None:
        self.accepted_runs.append(self._run)
        self._run = 0

    @property
    def alpha(self) -> float | None:
        return self.N / self.K if self.K else None

    @property
    def eal(self) -> float | None:
        return self.n * self.N / self.K if self.K else None

    def run_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_runs).items()))

    def as_dict(self) -> dict:
        return {"n": self.n, "N": self.N, "K": self.K, "alpha": self.alpha, "eal": self.eal,
                "rollbacks": self.rollbacks, "accepted_run_histogram": self.run_histogram(),
                "sources": {source: list(counts) for source, counts in sorted(self.sources.items())},
                "stage_rows": list(self.stage_rows), "step_rows": dict(sorted(self.step_rows.items())),
                "restarts": self.restarts}


def pooled_eal(stats: list[DecodeStats]) -> float | None:
    """Pool a data set as n * sum(N) / sum(K) (all samples share n)."""
    total_k = sum(s.K for s in stats)
    return stats[0].n * sum(s.N for s in stats) / total_k if total_k else None


@dataclass
class ChainStats:
    """Draft-then-verify decoding (EAGLE-3's chain): each cycle drafts m tokens and runs the target once.

    tau = tokens settled per cycle, the bonus or correction token included (N - 1 over cycles: the first token
    comes from the prefill); S = tau * L / (L_s * m + L) counts the m draft passes as L_s layers each."""

    m: int
    N: int = 0
    cycles: int = 0
    accepted: int = 0
    drafted: int = 0                  # draft tokens proposed (those after a rejected one are never verified)
    drafting_cycles: int = 0          # cycles that proposed at least one token (a lookup may find nothing to copy)
    accepted_per_cycle: list[int] = field(default_factory=list)
    sources: dict[str, list[int]] = field(default_factory=dict)   # draft source -> [drafts verified, accepted]
    verdicts: list[tuple[int, str, bool]] = field(default_factory=list)   # as DecodeStats.verdicts

    def verified(self, source: str, accepted: bool) -> None:
        """Called before the verified token is counted in N (N is then its index among the generated tokens)."""
        count_source(self.sources, source, accepted)
        self.verdicts.append((self.N, source, accepted))

    def cycle(self, drafted: int, accepted: int) -> None:
        """One cycle verified `drafted` drafts and kept `accepted` of them (every decoder of chains counts here)."""
        self.cycles += 1
        self.drafted += drafted
        self.drafting_cycles += drafted > 0
        self.accepted += accepted
        self.accepted_per_cycle.append(accepted)

    @property
    def tau(self) -> float | None:
        return (self.N - 1) / self.cycles if self.cycles else None

    def speedup(self, num_layers: int, module_layers: int) -> float | None:
        return None if self.tau is None else self.tau * num_layers / (module_layers * self.m + num_layers)

    def as_dict(self) -> dict:
        return {"m": self.m, "N": self.N, "cycles": self.cycles, "accepted": self.accepted, "drafted": self.drafted,
                "tau": self.tau,
                "accepted_histogram": dict(sorted(Counter(self.accepted_per_cycle).items())),
                "sources": {source: list(counts) for source, counts in sorted(self.sources.items())}}
