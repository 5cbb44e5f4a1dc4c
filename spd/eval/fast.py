"""The target's greedy traces, which every exact fast evaluator replays (spd.eval.fast_trace, spd.eval.fast_chain).

A causal target gives every in-flight token exactly the hidden states it has in plain decoding over the same
prefix. So a greedy speculative decode (every rollback, every K) follows from the target's own greedy decode with the
hidden states its drafter reads, recorded here during the project's incremental AR decoding (the numerical path the
runtimes run), and from the drafter's proposals on it: the replays run the runtimes' own loops over the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spd.engine import build_batch_decoder, build_decoder
from spd.methods import AR
from spd.decoding import Request
from spd.layout import needed_layers
from spd.verify.sampling import top2_margin
from spd.targets.stages import StagedTarget


def draft_table(logits: torch.Tensor, draft_to_target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A trained drafter's greedy drafts over a trace, from its logits [k, T, V'] (k occupancies or chain steps):
    draft ids [k, T] in the target's vocabulary and the drafter's top-2 margins [k, T]."""
    top2 = torch.topk(logits.float(), 2, dim=-1)
    drafts = top2.indices[..., 0]
    if draft_to_target is not None:
        drafts = draft_to_target[drafts]
    return drafts, top2.values[..., 0] - top2.values[..., 1]


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
