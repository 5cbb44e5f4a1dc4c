"""Lookup inside SPD's pipeline (`draft_source=lookup+module`): each step proposes the context lookup's next token
when the context — prompt, verified tokens and the drafts in flight — ends with a suffix of at least
`lookup_min_ngram` tokens that occurred earlier, and the speculation module's draft otherwise.

The module keeps its state either way: its memory grows as positions leave the last stage (`finalize`), which the
lookup never skips; only its forward for the draft is saved when the lookup answers. A lookup draft is a point
mass (q = None), verified like any other draft (spd.sampling), so the output stays the target's.
"""

from __future__ import annotations

from spd.drafters.base import Drafter, StepView
from spd.drafters.lookup import NgramIndex
from spd.methods import DRAFT_SOURCES, LOOKUP_MODULE, MODULE
from spd.sampling import Proposal


class LookupThenModule(Drafter):
    def __init__(self, module: Drafter, min_n: int = 2, max_n: int = 8):
        self.module = module
        self.min_n, self.max_n = min_n, max_n
        self.after_step = module.after_step

    def layers_needed(self, bounds):
        return self.module.layers_needed(bounds)

    def start(self, prompt_hidden, prompt_ids):
        self.module.start(prompt_hidden, prompt_ids)
        self.index = NgramIndex(self.min_n, self.max_n)   # every position up to the newest in flight
        self.index.extend(list(prompt_ids))

    def draft(self, view: StepView, propose) -> Proposal:
        for item in view.in_flight:
            if item.pos == len(self.index):      # the newest token (a draft, or a correction after a rollback)
                self.index.extend([item.token])
        assert len(self.index) == view.t + 1, (len(self.index), view.t)
        n, start = self.index.match()
        if n:
            return Proposal(self.index.continuation(start, 1)[0], source="lookup")
        return self.module.draft(view, propose)

    def finalize(self, pos, hidden):
        self.module.finalize(pos, hidden)

    def on_rollback(self, length):
        self.module.on_rollback(length)
        self.index.truncate(length)


def with_draft_source(module_drafter: Drafter, source: str, min_n: int, max_n: int) -> Drafter:
    """The pipelined drafter a run uses: the module's alone, or the lookup in front of it."""
    if source == MODULE:
        return module_drafter
    if source == LOOKUP_MODULE:
        return LookupThenModule(module_drafter, min_n, max_n)
    raise ValueError(f"draft source {source!r}: one of {', '.join(DRAFT_SOURCES)}")
