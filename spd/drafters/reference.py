"""Drafters that know the target's own continuation: an oracle (always right) and an always-wrong one.

They check the metric arithmetic (oracle: K = N + n - 2; always wrong: alpha ~ 1/n) and, wrapping a real
drafter whose compute they keep, let benchmarks hold the pipeline full to time steady-state steps.
"""

from __future__ import annotations

from spd.drafters.base import AFTER_STEP, PIPELINED, ROLLBACK, Drafter, StepView, WrappedDrafter
from spd.verify.sampling import Proposal


class _Idle(Drafter):
    """Reads nothing and drafts nothing: the inner drafter of a reference drafter that times no real one."""
    capabilities = frozenset({PIPELINED})

    def propose(self, view, propose):
        return None

    def observe(self, hidden, tokens):
        pass


class ReferenceDrafter(WrappedDrafter):
    """Drafts reference[pos] (or any other token when `wrong`) for the position being proposed.

    reference: the full token sequence (prompt + the target's own greedy continuation).
    inner: optional drafter run for its cost only (its logits are discarded).
    """

    def __init__(self, reference: list[int], vocab_size: int, wrong: bool = False, inner: Drafter | None = None):
        super().__init__(inner or _Idle())
        self.reference = reference
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.capabilities = frozenset({PIPELINED}) | (self.capabilities & {AFTER_STEP, ROLLBACK})

    def propose(self, view: StepView, propose) -> Proposal:
        self.inner.propose(view, propose)
        pos = view.t + 1
        right = self.reference[pos] if pos < len(self.reference) else 0
        return Proposal((right + 1) % self.vocab_size if self.wrong else right, source="reference")
