"""The pipeline schedule, tensor-free: which position each stage advances in a step, who leaves the last stage,
which token that verifies, and what a rejection flushes.

Every executor (in-process, one process per stage) and every consumer that reasons about pipeline timing (the
decoding loop, the exact replay of the fast evaluator, the calibration's steady state) reads it from here.

Positions are 0-indexed. In an SPD step the in-flight tokens are the contiguous positions t-a+1..t, the token at
position t-j having passed j stages (depth j), so stage s (0-indexed) advances position t-s, for s < a.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE = -1  # a stage with nothing to run this step


@dataclass(frozen=True)
class Step:
    n: int                  # pipeline stages
    work: tuple[int, ...]   # work[s] = position stage s advances in this step, IDLE if none
    t: int                  # newest position in flight (about to enter stage 1)
    occupancy: int          # tokens in flight, the newest included (a in the paper)

    @property
    def exiting(self) -> int | None:
        """The position that leaves the last stage after this step (its final hidden state gives p), if any."""
        last = self.work[-1]
        return None if last == IDLE else last

    @property
    def candidate(self) -> int:
        """The position the exiting token verifies: the next-oldest in flight (for n = 1, the draft made now)."""
        return self.exiting + 1

    def in_flight(self) -> list[tuple[int, int]]:
        """(position, depth) of every token in flight when the step begins, oldest first."""
        return [(pos, self.t - pos) for pos in range(self.t - self.occupancy + 1, self.t + 1)]

    def runs(self, stage: int) -> bool:
        return self.work[stage] != IDLE


def spd_step(t: int, occupancy: int, n: int) -> Step:
    if not 1 <= occupancy <= n:
        raise ValueError(f"occupancy {occupancy} outside 1..{n}")
    return Step(n, tuple(t - s if s < occupancy else IDLE for s in range(n)), t, occupancy)


def first_step(pos: int, n: int) -> Step:
    """After prefill (and after every rollback) one token is in flight: the pipeline refills from a = 1."""
    return spd_step(pos, 1, n)


def next_step(step: Step, accepted: bool | None) -> Step:
    """The step after `step`. `accepted` is the verdict on step.candidate (None when nothing exited: warm-up).

    Warm-up grows the occupancy by one; in steady state one token exits and the new draft enters; a rejection
    flushes every in-flight token and the correction enters alone at the candidate's position."""
    if step.exiting is None:
        if accepted is not None:
            raise ValueError("nothing exited this step, so nothing was verified")
        return spd_step(step.t + 1, step.occupancy + 1, step.n)
    if accepted is None:
        raise ValueError(f"position {step.exiting} exited: its verdict on {step.candidate} is needed")
    if accepted:
        return spd_step(step.t + 1, step.n, step.n)
    return first_step(step.candidate, step.n)


def flushed_from(step: Step) -> int:
    """A rejection at the end of `step` forgets every position >= this one (every cache is cropped to it)."""
    return step.candidate


def relay_step(pos: int, stage: int, n: int) -> Step:
    """Plain pipeline-parallel AR: one token in flight, advancing through one stage per step."""
    return Step(n, tuple(pos if s == stage else IDLE for s in range(n)), pos, 1)


def segment_step(previous: Step | None, entering: int, n: int) -> Step:
    """FlowSpec's pipeline (spd.runtime.segments): segment `entering` (IDLE: none) enters stage 1, every segment in
    flight moves one stage on, the one in the last stage leaves. previous None: the pipeline was empty (the start,
    a flush). work[s] is a segment key here, not a position: the flight says which nodes it holds."""
    carried = (IDLE,) * (n - 1) if previous is None else previous.work[:-1]
    work = (entering, *carried)
    return Step(n, work, entering, sum(key != IDLE for key in work))
