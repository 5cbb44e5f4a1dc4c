"""Fast evaluators for greedy chain decoding (EAGLE-3's and the context lookup's), the chains' counterpart of
`spd.fast_eval`. Every one is the same loop, `replay`: a drafter drafts each cycle's tree (a chain is a tree of
width 1), `walk_trace` settles it against the trace's tokens.

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

import torch

from spd.drafters.base import ChainDrafter
from spd.drafters.lookup import LookupDrafter
from spd.eagle3_module import Eagle3Module
from spd.fast_eval import GreedyTrace
from spd.methods import SUFFIX_MODULE
from spd.metrics import ChainStats
from spd.sampling import Proposal, SamplingParams, propose
from spd.tree import DraftTree


@torch.no_grad()
def chain_drafts(module: Eagle3Module, trace: GreedyTrace, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ids [m, T] (target vocabulary) and the module's top-2 margins [m, T]: entry (j, i) is the j-th draft
    of a cycle whose newest verified position is i + 1 (it predicts x_{i+2+j})."""
    hidden = {layer: trace.hidden[layer] for layer in module.layers_needed()}
    logits = torch.stack([step[0] for step in module.forward_ttt(hidden, steps=m)]).float()  # [m, T, V']
    top2 = torch.topk(logits, 2, dim=-1)
    drafts = top2.indices[..., 0]
    if module.draft_to_target is not None:
        drafts = module.draft_to_target[drafts]
    return drafts, top2.values[..., 0] - top2.values[..., 1]


class PrecomputedChain(ChainDrafter):
    """EAGLE-3's chains read from `chain_drafts`' table, so the one replay (`replay`) walks them: drafts [m, T],
    entry (j, i) the j-th draft of a cycle whose newest verified position is i + 1."""

    def __init__(self, drafts: torch.Tensor):
        self.drafts = drafts.tolist()

    def layers_needed(self, bounds=None) -> list[int]:
        return []

    def start(self, prompt_hidden, tokens) -> None:
        self.newest = len(tokens) - 1

    def verified(self, hidden, tokens) -> None:
        self.newest = len(tokens) - 1

    def draft_tree(self, root: int, m: int, width: int, budget: int, propose=None) -> DraftTree:
        return DraftTree.chain(root, [Proposal(self.drafts[j][self.newest - 1]) for j in range(m)])


def replay_chain(m: int, prompt_ids: list[int], tokens: list[int], drafts: torch.Tensor) -> ChainStats:
    """Greedy chain decoding with `chain_drafts`' table replayed over the target's tokens (`replay`)."""
    return replay(PrecomputedChain(drafts), prompt_ids, tokens, m)["stats"]


def fast_chain_stats(module: Eagle3Module, trace: GreedyTrace, m: int) -> dict:
    """N, cycles, tau of greedy chain decoding with m drafts, plus the smallest margins that decided anything."""
    drafts, margins = chain_drafts(module, trace, m)
    stats = replay_chain(m, trace.prompt_ids, trace.tokens, drafts)
    return {"stats": stats, "min_module_margin": float(margins.min()) if margins.numel() else None,
            "min_target_margin": min(trace.margins)}


def walk_trace(tree, stats: ChainStats, tokens: list[int], on_settle=None) -> int:
    """One greedy verification of `tree` against the target's tokens (stats.N of them settled before it): down
    from the root along the trace to the first miss or a leaf. Updates stats; returns the accepted drafts."""
    node, accepted, total = 0, 0, len(tokens)
    while stats.N < total:
        children = tree.children(node)
        if not children:
            stats.N += 1                        # the path held: the target's next token comes free
            break
        hit = next((c for c in children if tree.token(c) == tokens[stats.N]), None)
        source = tree.proposals[(hit or children[0]) - 1].source
        stats.verified(source, hit is not None)
        if on_settle:
            on_settle(stats.N, hit is not None, source)
        stats.N += 1
        if hit is None:
            break
        node, accepted = hit, accepted + 1
    stats.cycles += 1
    stats.accepted += accepted
    stats.accepted_per_cycle.append(accepted)
    return accepted


@torch.no_grad()
def replay(drafter: ChainDrafter, prompt_ids: list[int], tokens: list[int], m: int, width: int = 1,
           budget: int | None = None, hidden: dict[int, torch.Tensor] | None = None, on_settle=None,
           margins: list[float] | None = None, draws=None, chances: list[float] | None = None) -> dict:
    """The one greedy replay of draft-then-verify decoding over the target's tokens: `drafter` (the runtime's own,
    fresh) drafts each cycle's tree, fed the verified tokens and — from hidden {layer: [1, P + N - 1, d]}, the
    trace's states — the verified path's states, as the verify pass captures them; `walk_trace` settles it. Only
    the target's verify forward is skipped: greedy descends along the trace's tokens, and off that path no node's
    verdict matters. Returns the statistics and the target rows each cycle fed (its tree's nodes, the root
    included), which decide its cost on a CPU (experiments/lookup_grid.py). on_settle(pos, accepted, source): called for
    every verified node (pos: its index in `tokens`). margins: the trace's top-2 logit margins (margins[i] where the
    target chose tokens[i]), told to the drafter as the runtime tells it. draws: a sampled answer's keyed draws
    (anything with `uniform(position, token)` and `chance(position)`), given to the drafter after `start` as the
    runtime gives them; chances: the target's p of each sampled token (chances[i] of tokens[i]), recorded in `draws`
    as the runtime's draws record them (spd.sampling.KeyedDraws.chance)."""
    hidden = {layer: hidden[layer] for layer in drafter.layers_needed()} if hidden else {}
    prompt_len, total = len(prompt_ids), len(tokens)
    seq = list(prompt_ids) + tokens[:1]
    drafter.start({layer: h[:, :prompt_len] for layer, h in hidden.items()}, seq)
    if draws is not None:
        if chances:
            draws.drawn.update({prompt_len + i: chance for i, chance in enumerate(chances)})
        drafter.sampling_draws(draws)
    if margins:
        drafter.target_margin(margins[0])
    greedy = SamplingParams()
    stats, rows = ChainStats(m=m, N=1), []
    while stats.N < total:
        fed = len(seq) - 1
        tree = drafter.draft_tree(seq[-1], m, width, budget or m, lambda logits: propose(logits, greedy, None))
        rows.append(len(tree))
        stats.drafted += len(tree) - 1
        stats.drafting_cycles += len(tree) > 1
        accepted = walk_trace(tree, stats, tokens, on_settle)
        seq = list(prompt_ids) + tokens[: stats.N]
        if stats.N < total:
            drafter.verified({layer: h[:, fed: fed + 1 + accepted] for layer, h in hidden.items()}, seq)
            if margins:
                drafter.target_margin(margins[stats.N - 1])
    return {"stats": stats, "rows_per_cycle": rows}


def fast_tree_stats(drafter: ChainDrafter, trace: GreedyTrace, m: int, width: int, budget: int) -> dict:
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
                     tree_nodes: int, draft_source: str | None = None, **_) -> dict:
    """EAGLE-3's exact greedy replay (spd.methods): its chain, or at W > 1 its dynamic tree — and beside the
    context's statistics (draft_source=suffix+module) at any W — drafted by the runtime's own drafter
    (make_drafter())."""
    if width > 1 or draft_source == SUFFIX_MODULE:
        return fast_tree_stats(make_drafter(), trace, draft_length, width, tree_nodes if width > 1 else draft_length)
    return fast_chain_stats(module, trace, draft_length)


def fast_lookup_eval(trace: GreedyTrace, *, ngrams: tuple[int, int], draft_length: int, width: int,
                     tree_nodes: int, **_) -> dict:
    """The context lookup's exact greedy replay (spd.methods), chain or tree."""
    return fast_lookup_stats(trace, *ngrams, draft_length, width=width, budget=tree_nodes if width > 1 else None)


def fast_suffix_eval(trace: GreedyTrace, *, make_drafter, draft_length: int, width: int, tree_nodes: int,
                     **_) -> dict:
    """The context statistics' exact greedy replay (spd.methods): the runtime's own drafter (make_drafter(), fresh,
    priced with the session's row costs), chain or tree."""
    return fast_tree_stats(make_drafter(), trace, draft_length, width, tree_nodes if width > 1 else draft_length)
