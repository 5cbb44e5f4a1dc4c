"""Drafters that know the target's own continuation: an oracle (always right) and an always-wrong one.

They check the metric arithmetic (oracle: K = N + n - 2; always wrong: alpha ~ 1/n) and, wrapping a real
drafter whose compute they keep, let benchmarks hold the pipeline full to time steady-state steps.
"""

from __future__ import annotations

from spd.drafters.base import Drafter, StepView
from spd.sampling import Proposal


class ReferenceDrafter(Drafter):
    """Drafts reference[pos] (or any other token when `wrong`) for the position being proposed.

    reference: the full token sequence (prompt + the target's own greedy continuation).
    inner: optional drafter run for its cost only (its logits are discarded).
    """

    def __init__(self, reference: list[int], vocab_size: int, wrong: bool = False, inner: Drafter | None = None):
        self.reference = reference
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.inner = inner
        self.after_step = inner.after_step if inner else False

    def layers_needed(self, bounds):
        return self.inner.layers_needed(bounds) if self.inner else []

    def start(self, prompt_hidden, prompt_ids):
        if self.inner:
            self.inner.start(prompt_hidden, prompt_ids)

    def finalize(self, pos, hidden):
        if self.inner:
            self.inner.finalize(pos, hidden)

    def on_rollback(self, length):
        if self.inner:
            self.inner.on_rollback(length)

    def draft(self, view: StepView, propose) -> Proposal:
        if self.inner:
            self.inner.draft(view, propose)
        pos = view.t + 1
        right = self.reference[pos] if pos < len(self.reference) else 0
        return Proposal((right + 1) % self.vocab_size if self.wrong else right, source="reference")
