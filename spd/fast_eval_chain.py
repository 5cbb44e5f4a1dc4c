"""Fast evaluators for greedy chain decoding (EAGLE-3's and the context lookup's), the chains' counterpart of
`spd.fast_eval`.

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
from spd.metrics import ChainStats
from spd.sampling import SamplingParams, propose


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


def replay_chain(m: int, prompt_len: int, tokens: list[int], drafts: torch.Tensor) -> ChainStats:
    """Replay greedy chain decoding over the target's N tokens: each cycle keeps the drafts that match, up to the
    first miss, plus the target's token there (or after the m-th draft); the last cycle stops at the end."""
    stats = ChainStats(m=m, N=1)
    seq = [None] * prompt_len + tokens
    drafts = drafts.tolist()
    total = len(tokens)
    while stats.N < total:
        newest = prompt_len + stats.N - 1            # position of the newest settled token
        matched = 0
        while matched < m and newest + 1 + matched < len(seq) and \
                drafts[matched][newest - 1] == seq[newest + 1 + matched]:
            matched += 1
        left = total - stats.N
        accepted = min(matched, left)
        stats.cycles += 1
        stats.accepted += accepted
        stats.accepted_per_cycle.append(accepted)
        stats.N += min(matched + 1, left)
    return stats


def fast_chain_stats(module: Eagle3Module, trace: GreedyTrace, m: int) -> dict:
    """N, cycles, tau of greedy chain decoding with m drafts, plus the smallest margins that decided anything."""
    drafts, margins = chain_drafts(module, trace, m)
    stats = replay_chain(m, len(trace.prompt_ids), trace.tokens, drafts)
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
def fast_tree_stats(drafter: ChainDrafter, trace: GreedyTrace, m: int, width: int, budget: int) -> dict:
    """Greedy draft trees (W = width, `budget` nodes; EAGLE-3's dynamic tree: an `Eagle3Drafter`) replayed over the
    target's trace with the runtime's drafter, fresh; also the target rows each cycle would feed (the root
    included)."""
    hidden = {layer: trace.hidden[layer] for layer in drafter.layers_needed()}
    prompt_len, total = len(trace.prompt_ids), len(trace.tokens)
    tokens = list(trace.prompt_ids) + trace.tokens[:1]
    drafter.start({layer: h[:, :prompt_len] for layer, h in hidden.items()}, tokens)
    greedy = SamplingParams()
    stats, rows = ChainStats(m=m, N=1), []
    while stats.N < total:
        fed = len(tokens) - 1
        tree = drafter.draft_tree(tokens[-1], m, width, budget, lambda logits: propose(logits, greedy, None))
        rows.append(len(tree))
        stats.drafted += len(tree) - 1
        stats.drafting_cycles += len(tree) > 1
        accepted = walk_trace(tree, stats, trace.tokens)
        tokens = list(trace.prompt_ids) + trace.tokens[: stats.N]
        if stats.N < total:       # the root's and the accepted nodes' states, as the verify pass captures them
            drafter.verified({layer: h[:, fed: fed + 1 + accepted] for layer, h in hidden.items()}, tokens)
    return {"stats": stats, "rows_per_cycle": rows, "min_target_margin": min(trace.margins)}


def fast_lookup_stats(trace: GreedyTrace, min_n: int, max_n: int, m: int, on_settle=None, width: int = 1,
                      budget: int | None = None) -> dict:
    """Greedy lookup chain (method=lookup; W > 1: its trees) replayed over the target's tokens with the runtime's
    own drafter: a lookup reads only tokens, and in greedy decoding the verified tokens are the trace's, so this is
    exact. Also the target rows each cycle fed (its tree's nodes, the root included), which decide its cost on a
    CPU (bench/lookup_grid.py). on_settle(pos, accepted, source): called for every verified node (pos: its index
    in trace.tokens)."""
    drafter = LookupDrafter(min_n, max_n)
    tokens = list(trace.prompt_ids) + trace.tokens[:1]
    drafter.start(None, tokens)
    stats, rows, total = ChainStats(m=m, N=1), [], len(trace.tokens)
    while stats.N < total:
        tree = drafter.draft_tree(tokens[-1], m, width, budget or m)
        rows.append(len(tree))
        walk_trace(tree, stats, trace.tokens, on_settle)
        tokens = list(trace.prompt_ids) + trace.tokens[: stats.N]
        drafter.verified(None, tokens)
    return {"stats": stats, "rows_per_cycle": rows, "min_target_margin": min(trace.margins)}


def fast_eagle3_eval(trace: GreedyTrace, *, module: Eagle3Module, make_drafter, draft_length: int, width: int,
                     tree_nodes: int, **_) -> dict:
    """EAGLE-3's exact greedy replay (spd.methods): its chain, or at W > 1 its dynamic tree drafted by the
    runtime's own drafter (make_drafter())."""
    if width > 1:
        return fast_tree_stats(make_drafter(), trace, draft_length, width, tree_nodes)
    return fast_chain_stats(module, trace, draft_length)


def fast_lookup_eval(trace: GreedyTrace, *, ngrams: tuple[int, int], draft_length: int, width: int,
                     tree_nodes: int, **_) -> dict:
    """The context lookup's exact greedy replay (spd.methods), chain or tree."""
    return fast_lookup_stats(trace, *ngrams, draft_length, width=width, budget=tree_nodes if width > 1 else None)
