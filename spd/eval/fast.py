"""Exact fast evaluator for greedy SPD.

A causal target gives every in-flight token exactly the hidden states it has in plain decoding over the same
prefix. So the whole greedy SPD trace (every rollback, every K) follows from
  1. the target's own greedy decode, with the hidden states the features need, recorded during the project's
     incremental AR decoding (the numerical path the pipeline runs), and
  2. the module's draft at every (position t, occupancy a), from n batched training-layout passes.
A draft only matters when every token before it is correct (otherwise a rollback flushes it first), so drafts
are scored against the target's own tokens and the pipeline's timing is replayed without running the target.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from spd.engine import build_batch_decoder, build_decoder
from spd.methods import AR, LOOKUP_MODULE
from spd.decoding import Request
from spd.drafters.lookup import NgramIndex
from spd.layout import needed_layers
from spd.metrics import DecodeStats
from spd.module import SpeculationModule
from spd.runtime.schedule import first_step, flushed_from, next_step
from spd.pricing import SourcePricer
from spd.sampling import top2_margin
from spd.targets.stages import StagedTarget


@dataclass
class GreedyTrace:
    prompt_ids: list[int]
    tokens: list[int]                  # the target's N greedy tokens
    hidden: dict[int, torch.Tensor]    # {layer: H^layer [1, P + N - 1, d]}, every position ever fed
    margins: list[float]               # target's top-2 logit margin when choosing each token


def record_greedy_trace(staged: StagedTarget, prompt_ids: list[int], max_new_tokens: int,
                        eos_ids: frozenset[int], layers: list[int] | None = None) -> GreedyTrace:
    """Incremental greedy AR decoding (bitwise the pipeline's path) that keeps `layers` (default: what the layout's
    features read) of every position."""
    capture = frozenset(needed_layers(staged.bounds) if layers is None else layers)
    parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in capture}
    margins = []

    def observe(logits, captured):
        margins.append(top2_margin(logits))
        for layer, h in captured.items():
            parts[layer].append(h)

    decoder = build_decoder(AR, staged, eos_ids, capture=capture, observe=observe)
    tokens = list(decoder.stream(prompt_ids, Request(max_new_tokens)))
    return GreedyTrace(list(prompt_ids), tokens, {k: torch.cat(v, 1) for k, v in parts.items()}, margins)


def record_greedy_traces(staged: StagedTarget, prompts: list[list[int]], max_new_tokens: int,
                         eos_ids: frozenset[int], layers: list[int], batch_size: int):
    """`record_greedy_trace` for many prompts, batch_size of them per target forward (spd.runtime.batch): yields
    (index, trace, seconds from admission to its last token) as each finishes. The tokens equal the one-at-a-time
    recording up to the rounding of wider matrix products (a difference can only start at a near-tie)."""
    capture = frozenset(layers)
    decoder = build_batch_decoder(AR, staged, eos_ids, max_batch=batch_size, capture=capture)
    records = []

    def observer(parts, margins):
        def observe(logits, captured):
            margins.append(top2_margin(logits))
            for layer in capture:
                parts[layer].append(captured[layer])
        return observe

    for ids in prompts:
        parts, margins = {layer: [] for layer in capture}, []
        records.append((parts, margins, decoder.submit(ids, Request(max_new_tokens), observer(parts, margins))))
    reported = set()
    while decoder.busy:
        decoder.step()
        for index, (parts, margins, ticket) in enumerate(records):
            if ticket.done and index not in reported:
                reported.add(index)
                trace = GreedyTrace(list(ticket.prompt_ids), ticket.tokens,
                                    {k: torch.cat(v, 1) for k, v in parts.items()}, margins)
                yield index, trace, ticket.seconds


@torch.no_grad()
def module_drafts(module: SpeculationModule, trace: GreedyTrace) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft token ids [n, T] and the module's top-2 margins [n, T] for every (occupancy a = row + 1, position t)."""
    n = module.n
    feats = {k: f.expand(n, -1, -1) for k, f in module.features(trace.hidden).items()}
    logits = module.forward_layout(feats, torch.arange(1, n + 1))  # [n, T, V']
    logits = logits.float()
    top2 = torch.topk(logits, 2, dim=-1)
    drafts = top2.indices[..., 0]
    if module.draft_to_target is not None:
        drafts = module.draft_to_target[drafts]
    return drafts, top2.values[..., 0] - top2.values[..., 1]


def lookup_drafts(trace: GreedyTrace, min_n: int, max_n: int) -> dict[int, tuple[int, int]]:
    """{t: (the context lookup's draft for position t + 1, the match's length)} wherever the target's own sequence
    up to t ends with a suffix that occurred earlier. In a decisive step every token in flight is the target's own,
    so this is what the runtime's lookup (spd.drafters.hybrid) sees there, whatever the occupancy."""
    seq = trace.prompt_ids + trace.tokens
    index = NgramIndex(min_n, max_n)
    out = {}
    for t in range(len(seq) - 1):
        index.extend([seq[t]])
        n, start = index.match()
        if n:
            out[t] = (index.continuation(start, 1)[0], n)
    return out


def replay(n: int, prompt_len: int, tokens: list[int], drafts: torch.Tensor,
           lookup: dict[int, tuple[int, int]] | None = None, pricer: SourcePricer | None = None,
           on_settle=None) -> tuple[DecodeStats, Counter]:
    """Replay the pipeline's schedule: K, rollbacks, accepted runs, and the occupancy of every *decisive* step
    (one whose draft matters because no wrong token is in flight; the others are flushed unseen).
    lookup: {t: (the context's draft for t + 1, its match length)} (`lookup_drafts`), drafted instead of the
    module's — where `pricer` (the runtime's, fresh) prefers it, told of every decisive draft and every verdict when
    the runtime tells it (a non-decisive draft is discarded by a rollback before any verdict, in both).
    on_settle(pos, accepted, source): called for every verified position (analyses of where acceptance falls)."""
    stats = DecodeStats(n=n, N=1)
    decisive: Counter = Counter()
    total = len(tokens)
    if total == 1:
        stats.finish()
        return stats, decisive
    seq = [None] * prompt_len + tokens
    drafts = drafts.tolist()
    step = first_step(prompt_len, n)
    own = {prompt_len: True}          # pos -> the in-flight token there is the target's own
    sources: dict[int, str] = {}      # pos -> who drafted its decisive draft (the lookup or the module)
    while True:
        t, a = step.t, step.occupancy
        clean = all(own[pos] for pos, _ in step.in_flight())
        draft = drafts[a - 1][t] if t + 1 < len(seq) else None
        if clean and t + 1 < len(seq):
            decisive[a] += 1
            found = (lookup or {}).get(t)
            sources[t + 1] = "module"
            if found is not None and (pricer is None or pricer.prefers_lookup(found[1])):
                draft, sources[t + 1] = found[0], "lookup"
            if pricer is not None:
                pricer.drafted(t + 1, found[1] if sources[t + 1] == "lookup" else None)
        own[t + 1] = clean and draft is not None and draft == seq[t + 1]
        stats.K += 1
        if step.exiting is None:
            step = next_step(step, None)
            continue
        if pricer is not None:
            pricer.finalize(step.exiting)
        accepted = own[step.candidate]
        source = sources.pop(step.candidate, "module")
        stats.settle(accepted, source)
        if on_settle:
            on_settle(step.candidate, accepted, source)
        if not accepted:
            own = {flushed_from(step): True}  # the correction is the target's own token
            if pricer is not None:
                pricer.rollback(flushed_from(step))
        if stats.N == total:
            break
        step = next_step(step, accepted)
    stats.finish()
    return stats, decisive


def fast_greedy_stats(module: SpeculationModule, trace: GreedyTrace,
                      lookup: tuple[int, int] | None = None, on_settle=None, priced: bool = False) -> dict:
    """N, K, L'acc, rollbacks of greedy SPD with `module`, plus the smallest module margin that decided a draft.
    lookup: (shortest, longest n-gram) for draft_source=lookup+module — the lookup's draft wherever it has one, or,
    priced, where it is predicted likelier kept than the module's (spd.pricing.SourcePricer)."""
    drafts, margins = module_drafts(module, trace)
    found = lookup_drafts(trace, *lookup) if lookup is not None else None
    pricer = SourcePricer() if lookup is not None and priced else None
    stats, decisive = replay(module.n, len(trace.prompt_ids), trace.tokens, drafts, found, pricer, on_settle)
    return {"stats": stats, "decisive_occupancy": dict(sorted(decisive.items())),
            "min_module_margin": float(margins.min()) if margins.numel() else None,
            "min_target_margin": min(trace.margins)}


def fast_pipeline_eval(trace: GreedyTrace, *, module: SpeculationModule, draft_source: str,
                       ngrams: tuple[int, int], source_pricing: bool = False) -> dict:
    """A pipelined method's exact greedy replay (spd.methods): the module's drafts, the lookup's in front of them
    where draft_source says so (source_pricing: where it is predicted likelier kept)."""
    return fast_greedy_stats(module, trace, ngrams if draft_source == LOOKUP_MODULE else None,
                             priced=source_pricing)
