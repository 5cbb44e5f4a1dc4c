"""Fast evaluators for greedy chain decoding (EAGLE-3's and the context lookup's), the chains' counterpart of
`spd.eval.fast`. Every one is the same replay, `replay`: the runtime's own walk (spd.runtime.sequence) with a
drafter drafting each cycle's tree (a chain is a tree of width 1), its verification forward read from the trace
(`TraceVerifier`), as FlowSpec's and PipeDec's replays read their stages from it (spd.eval.fast_trace).

EAGLE-3: in greedy decoding a draft only matters while every draft before it in the cycle was right, and then the tokens
it was fed are the target's own. So the training-time test's pass over a recorded greedy trace (step-0 rows from
the target's states, step j at row i = the j-th draft of a cycle that starts after verified position i) gives
every draft any cycle could make, in m batched steps; the cycles themselves are replayed from the target's tokens.
What differs from the step-by-step chain is arithmetic only: the runtime's features come from the batched verify
pass and its drafts from incremental module steps, so a draft can change only at a near-tie
(bench/fast_eval_check_chain.py compares the two and lists every difference with its margins).
The lookup (`fast_lookup_stats`) reads tokens only, so replaying its own drafter over the trace is exact
(bench/fast_eval_check_chain.py --method lookup).
EAGLE-3's trees (`fast_tree_stats`): the runtime's own drafter drafts each cycle's tree, fed the trace's states of the
verified path; only the target's verify forward is skipped (greedy descends along the trace's tokens, and off that
path no node's verdict matters). The arithmetic caveat is the chain's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spd.decoding import Request
from spd.drafters.base import CHAIN, Cycle, Drafter
from spd.drafters.lookup import LookupDrafter
from spd.models.eagle3 import Eagle3Module
from spd.eval.fast import GreedyTrace, draft_table
from spd.methods import SUFFIX_MODULE
from spd.metrics import ChainStats
from spd.runtime.sequence import ChainSequence
from spd.verify.sampling import BLOCK, Proposal
from spd.verify.tree import DraftTree


@torch.no_grad()
def chain_drafts(module: Eagle3Module, trace: GreedyTrace, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ids [m, T] (target vocabulary) and the module's top-2 margins [m, T]: entry (j, i) is the j-th draft
    of a cycle whose newest verified position is i + 1 (it predicts x_{i+2+j})."""
    hidden = {layer: trace.hidden[layer] for layer in module.layers_needed()}
    logits = torch.stack([step[0] for step in module.forward_ttt(hidden, steps=m)])   # [m, T, V']
    return draft_table(logits, module.draft_to_target)


class PrecomputedChain(Drafter):
    """EAGLE-3's chains read from `chain_drafts`' table, so the one replay (`replay`) walks them: drafts [m, T],
    entry (j, i) the j-th draft of a cycle whose newest verified position is i + 1."""
    capabilities = frozenset({CHAIN})

    def __init__(self, drafts: torch.Tensor):
        self.drafts = drafts.tolist()

    def start(self, prompt_hidden, tokens) -> None:
        self.newest = len(tokens) - 1

    def observe(self, hidden, tokens) -> None:
        self.newest = len(tokens) - 1

    def propose(self, cycle: Cycle, choose=None) -> DraftTree:
        return DraftTree.chain(cycle.root, [Proposal(self.drafts[j][self.newest - 1]) for j in range(cycle.m)])


def replay_chain(m: int, prompt_ids: list[int], tokens: list[int], drafts: torch.Tensor) -> ChainStats:
    """Greedy chain decoding with `chain_drafts`' table replayed over the target's tokens (`replay`)."""
    return replay(PrecomputedChain(drafts), prompt_ids, tokens, m)["stats"]


def fast_chain_stats(module: Eagle3Module, trace: GreedyTrace, m: int) -> dict:
    """N, cycles, tau of greedy chain decoding with m drafts, plus the smallest margins that decided anything."""
    drafts, margins = chain_drafts(module, trace, m)
    stats = replay_chain(m, trace.prompt_ids, trace.tokens, drafts)
    return {"stats": stats, "min_module_margin": float(margins.min()) if margins.numel() else None,
            "min_target_margin": min(trace.margins)}


class TraceVerifier:
    """The chain's verification forward read from a greedy trace instead of run: a node on the trace (its path from
    the root is the trace's tokens) gets logits whose argmax is the trace's next token, with the trace's top-2 margin
    there (inf when the trace has none: a drafter told no margin keeps its own), and the trace's states at its
    position. Greedy settles only along the trace, so what a node off it would choose is never read."""

    def __init__(self, prompt_ids: list[int], tokens: list[int], hidden: dict[int, torch.Tensor] | None,
                 margins: list[float] | None):
        self.sequence = list(prompt_ids) + list(tokens)
        self.prompt = len(prompt_ids)
        self.hidden = hidden or {}
        self.margins = margins
        self.device = torch.device("cpu")      # where ChainSequence seeds the request's generator
        # one buffer for every cycle's rows, cleared where the last cycle wrote: a fresh [T, V] each cycle and an
        # argmax over a row of no BLOCK multiple cost the replay more than its drafter does
        self.rows = torch.full((1, -(-(max(self.sequence) + 2) // BLOCK) * BLOCK), float("-inf"))
        self.written: tuple[torch.Tensor, torch.Tensor] | None = None

    def _logits(self, positions: list[int | None]) -> torch.Tensor:
        """Row i chooses the trace's token after positions[i] (None: off the trace, an arbitrary row). The chosen
        token scores 0 and the runner-up, after it, minus the margin: a tie still chooses the token (ties go to the
        lowest id), and top2_margin reads the margin back bit for bit."""
        if len(positions) > len(self.rows):
            self.rows, self.written = torch.full((len(positions), self.rows.shape[1]), float("-inf")), None
        rows = self.rows
        if self.written is not None:
            rows[self.written] = float("-inf")
        at, tokens, values = [], [], []
        for i, pos in enumerate(positions):
            token = 0 if pos is None else self.sequence[pos + 1]
            at += [i]
            tokens += [token]
            values += [0.0]
            if pos is not None and self.margins:
                at += [i]
                tokens += [token + 1]
                values += [-self.margins[pos + 1 - self.prompt]]
        self.written = (torch.tensor(at), torch.tensor(tokens))
        rows[self.written] = torch.tensor(values)
        return rows[:len(positions)]

    def _states(self, positions: list[int]) -> dict[int, torch.Tensor]:
        return {layer: h[:, [min(pos, h.shape[1] - 1) for pos in positions]] for layer, h in self.hidden.items()}

    def prefill(self) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The prompt's logits at its last position and the prompt's states."""
        return self._logits([self.prompt - 1])[0], {layer: h[:, :self.prompt] for layer, h in self.hidden.items()}

    def forward(self, tree: DraftTree, fed: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """logits [T, V'] and states {layer: [1, T, d]} of every node of `tree`, its root at position `fed`."""
        depths, on = tree.depths(), [True]
        for node in range(1, len(tree)):
            pos = fed + depths[node]
            on.append(on[tree.parent(node)] and pos < len(self.sequence) and tree.token(node) == self.sequence[pos])
        positions = [fed + d for d in depths]
        chosen = [pos if ok and pos + 1 < len(self.sequence) else None for pos, ok in zip(positions, on)]
        return self._logits(chosen), self._states(positions)


class _NoCache:
    def keep(self, start: int, positions: list[int]) -> None:
        """Nothing is cached: the trace holds every state."""


@dataclass(frozen=True)
class _Replayed(Request):
    """A greedy request whose drafter is told a sampled answer's keyed draws (None: greedy's none)."""
    keyed_draws: object = None

    def draws(self, generator, vocab):
        return self.keyed_draws


@torch.no_grad()
def replay(drafter: Drafter, prompt_ids: list[int], tokens: list[int], m: int, width: int = 1,
           budget: int | None = None, hidden: dict[int, torch.Tensor] | None = None, on_settle=None,
           margins: list[float] | None = None, draws=None, chances: list[float] | None = None) -> dict:
    """The one greedy replay of draft-then-verify decoding over the target's tokens: the runtime's own walk
    (spd.runtime.sequence.ChainSequence) with `drafter` (the runtime's own, fresh), its verification forward read
    from the trace (`TraceVerifier`; hidden {layer: [1, P + N - 1, d]}: the trace's states, the verified path's fed to
    the drafter as the verify pass captures them). Only the target's forward is skipped: greedy descends along the
    trace's tokens, and off that path no node's verdict matters. Returns the statistics and the target rows each
    cycle fed (its tree's nodes, the root included), which decide its cost on a CPU (experiments/lookup_grid.py).
    on_settle(pos, accepted, source): called for every verified node (pos: its index in `tokens`). margins: the
    trace's top-2 logit margins (margins[i] where the target chose tokens[i]), told to a drafter that prices with
    them as the runtime tells it. draws: a sampled answer's keyed draws (anything with `uniform(position, token)` and
    `chance(position)`), given to the drafter after `start` as the runtime gives them; chances: the target's p of
    each sampled token (chances[i] of tokens[i]), recorded in `draws` as the runtime's draws record them
    (spd.verify.sampling.KeyedDraws.chance)."""
    if draws is not None and chances:
        draws.drawn.update({len(prompt_ids) + i: chance for i, chance in enumerate(chances)})
    verifier = TraceVerifier(prompt_ids, tokens, hidden, margins)
    seq = ChainSequence(verifier, drafter, frozenset(), prompt_ids, _Replayed(len(tokens), keyed_draws=draws), m,
                        width, budget)
    seq.cache = _NoCache()
    seq.start(*verifier.prefill())
    rows = []
    while not seq.done:
        tree = seq.draft()
        if seq.rows is not None:
            raise ValueError(f"{type(drafter).__name__} runs side rows beside its tree: their logits are in no trace")
        rows.append(len(tree))
        seq.settle(*verifier.forward(tree, seq.fed))
    if seq.tokens[len(prompt_ids):] != list(tokens):
        raise AssertionError("the replay left the trace: its verification must choose the trace's tokens")
    if on_settle:
        for pos, source, accepted in seq.stats.verdicts:
            on_settle(pos, accepted, source)
    return {"stats": seq.stats, "rows_per_cycle": rows}


def fast_tree_stats(drafter: Drafter, trace: GreedyTrace, m: int, width: int, budget: int) -> dict:
    """Greedy draft trees (W = width, `budget` nodes; EAGLE-3's dynamic tree: an `Eagle3Drafter`) replayed over the
    target's trace (`replay`)."""
    return {**replay(drafter, trace.prompt_ids, trace.tokens, m, width, budget, trace.hidden, margins=trace.margins),
            "min_target_margin": min(trace.margins)}


def fast_lookup_stats(trace: GreedyTrace, min_n: int, max_n: int, m: int, on_settle=None, width: int = 1,
                      budget: int | None = None) -> dict:
    """Greedy lookup chain (method=lookup; W > 1: its trees) replayed over the target's tokens with the runtime's
    own drafter (`replay`): a lookup reads only tokens, and in greedy decoding the verified tokens are the trace's,
    so this is exact."""
    return {**replay(LookupDrafter(min_n, max_n), trace.prompt_ids, trace.tokens, m, width, budget,
                     on_settle=on_settle), "min_target_margin": min(trace.margins)}


def fast_eagle3_eval(trace: GreedyTrace, *, module: Eagle3Module, make_drafter, draft_length: int, width: int,
                     tree_nodes: int, draft_source: str | None = None) -> dict:
    """EAGLE-3's exact greedy replay (spd.methods): its chain, or at W > 1 its dynamic tree — and beside the
    context's statistics (draft_source=suffix+module) at any W — drafted by the runtime's own drafter
    (make_drafter())."""
    if width > 1 or draft_source == SUFFIX_MODULE:
        return fast_tree_stats(make_drafter(), trace, draft_length, width, tree_nodes if width > 1 else draft_length)
    return fast_chain_stats(module, trace, draft_length)


def fast_lookup_eval(trace: GreedyTrace, *, ngrams: tuple[int, int], draft_length: int, width: int,
                     tree_nodes: int) -> dict:
    """The context lookup's exact greedy replay (spd.methods), chain or tree."""
    return fast_lookup_stats(trace, *ngrams, draft_length, width=width, budget=tree_nodes if width > 1 else None)


def fast_suffix_eval(trace: GreedyTrace, *, make_drafter, draft_length: int, width: int,
                     tree_nodes: int) -> dict:
    """The context statistics' exact greedy replay (spd.methods): the runtime's own drafter (make_drafter(), fresh,
    priced with the session's row costs), chain or tree."""
    return fast_tree_stats(make_drafter(), trace, draft_length, width, tree_nodes if width > 1 else draft_length)
