"""Lookup inside SPD's pipeline (`draft_source=lookup+module`): each step proposes the context lookup's next token
when the context — prompt, verified tokens and the drafts in flight — ends with a suffix of at least
`lookup_min_ngram` tokens that occurred earlier, and the speculation module's draft otherwise. Priced
(`source_pricing=true`, spd.pricing.SourcePricer): the lookup drafts only where its match's predicted acceptance,
learned from this request's verdicts, is at least the module's (chains; a tree's branches keep the lookup first).

The module keeps its state either way: its memory grows as positions leave the last stage (`observe`), which the
lookup never skips; only its forward for the draft is saved when the lookup answers. A lookup draft is a point
mass (q = None), verified like any other draft (spd.verify.sampling), so the output stays the target's.

In a draft tree (W > 1) each branch tip asks on its own context: the lookup's one child where the branch's context
ends in a match, and the module's W likeliest children otherwise (one batched pass for those tips).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spd.drafters.base import BATCHED, ROLLBACK, TOGETHER, Drafter, StepView, WrappedDrafter, propose_level, propose_together
from spd.drafters.lookup import NgramIndex
from spd.drafters.spd_module import ModuleDrafter
from spd.methods import DRAFT_SOURCES, LOOKUP_MODULE, MODULE
from spd.pricing import SourcePricer
from spd.verify.sampling import Proposal
from spd.spec import LookupOptions

if TYPE_CHECKING:
    from spd.drafters.suffix import SuffixMemory


class LookupThenModule(WrappedDrafter):
    """Wraps the module's drafter: its states, memory and rollbacks go to the module untouched; only the draft may
    come from the lookup instead."""

    def __init__(self, module: Drafter, min_n: int = 2, max_n: int = 8, priced: bool = False):
        super().__init__(module)
        self.capabilities = module.capabilities | {BATCHED, TOGETHER, ROLLBACK}
        self.min_n, self.max_n = min_n, max_n
        self.priced = priced
        self.pricer: SourcePricer | None = None

    @property
    def module(self) -> Drafter:
        return self.inner

    def start(self, prompt_hidden, tokens):
        super().start(prompt_hidden, tokens)
        self.index = NgramIndex(self.min_n, self.max_n)   # every position up to the newest in flight
        self.index.extend(list(tokens))
        self.pricer = SourcePricer() if self.priced else None     # each request learns its own

    def _lookup(self, view: StepView) -> Proposal | None:
        """The lookup's draft where the context ends in a match (and, priced, where it is likelier kept than the
        module's), else None."""
        for item in view.in_flight:
            if item.pos == len(self.index):      # the newest token (a draft, or a correction after a rollback)
                self.index.extend([item.token])
        assert len(self.index) == view.t + 1, (len(self.index), view.t)
        n, start = self.index.match()
        if self.pricer is not None:
            n = n if n and self.pricer.prefers_lookup(n) else 0
            self.pricer.drafted(view.t + 1, n or None)
        return Proposal(self.index.continuation(start, 1)[0], source="lookup") if n else None

    def propose(self, view: StepView, propose) -> Proposal:
        found = self._lookup(view)
        return found if found is not None else self.module.propose(view, propose)

    def observe(self, hidden, tokens):
        super().observe(hidden, tokens)
        if self.pricer is not None:
            self.pricer.finalize(len(tokens) - 1)

    @classmethod
    def propose_together(cls, drafters: list["LookupThenModule"], views: list[StepView], proposes: list) -> list:
        """Each sequence's lookup; the modules of those without a match draft together."""
        out = [drafter._lookup(view) for drafter, view in zip(drafters, views)]
        rest = [i for i, found in enumerate(out) if found is None]
        if rest:
            for i, proposal in zip(rest, propose_together([drafters[i].module for i in rest],
                                                          [views[i] for i in rest], [proposes[i] for i in rest])):
                out[i] = proposal
        return out

    def propose_branches(self, views: list[StepView], propose) -> list:
        """W > 1. Branches differ in their drafts in flight, so here the index holds only what they all share — the
        tokens before the oldest level in flight, and that level's one node (its token is settled) — and each branch
        adds its own newer tokens for its lookup, then takes them back. A lookup child scores log 1: a match is
        trusted as in the chain, and its branch is kept among the W."""
        shared = views[0].in_flight[0]
        assert all(view.in_flight[0].node == shared.node for view in views), "the oldest level is one node"
        if len(self.index) == shared.pos:          # it settled since the last step (or is the first token)
            self.index.extend([shared.token])
        assert len(self.index) == shared.pos + 1, (len(self.index), shared.pos)
        children: list = [None] * len(views)
        for i, view in enumerate(views):
            self.index.extend([item.token for item in view.in_flight[1:]])
            n, start = self.index.match()
            if n:
                children[i] = [(Proposal(self.index.continuation(start, 1)[0], source="lookup"), 0.0)]
            self.index.truncate(shared.pos + 1)
        rest = [i for i, found in enumerate(children) if found is None]
        if rest:
            for i, drafted in zip(rest, propose_level(self.module, [views[i] for i in rest], propose)):
                children[i] = drafted
        return children

    def rollback(self, length):
        super().rollback(length)
        self.index.truncate(length)
        if self.pricer is not None:
            self.pricer.rollback(length)


def with_draft_source(module_drafter: Drafter, source: str, min_n: int, max_n: int, priced: bool = False) -> Drafter:
    """The pipelined drafter a run uses: the module's alone, or the lookup in front of it (priced: where it pays)."""
    if source == MODULE:
        return module_drafter
    if source == LOOKUP_MODULE:
        return LookupThenModule(module_drafter, min_n, max_n, priced)
    raise ValueError(f"draft source {source!r}: one of {', '.join(DRAFT_SOURCES)}")


def pipelined_drafter(*, module, draft_source: str, lookup: LookupOptions, use_cache: bool) -> Drafter:
    """SPD's, PPSD's and the output-state ablation's drafter (spd.methods): the module, the lookup in front where
    draft_source says so (source_pricing: where its predicted acceptance is at least the module's)."""
    return with_draft_source(ModuleDrafter(module, use_cache), draft_source, lookup.min_ngram, lookup.max_ngram,
                             lookup.source_pricing)


def segment_drafter(*, draft_source: str, lookup: LookupOptions, memory: SuffixMemory | None):
    """FlowSpec's tree grower (spd.methods): the context's statistics (every candidate up to the tree's budget, no
    pricing: the segments' costs are not a chain's) or its lookup."""
    from spd.drafters.lookup import LookupDrafter
    from spd.drafters.suffix import SuffixDrafter

    if draft_source == "lookup":
        return LookupDrafter(lookup.min_ngram, lookup.max_ngram)
    return SuffixDrafter(1, lookup.max_ngram, costs=None, memory=memory)   # one-token matches too, as method=suffix
