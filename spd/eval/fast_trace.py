"""Exact greedy replays of FlowSpec and PipeDec: their own decoding loops (spd.runtime.segments, spd.runtime.pipeline)
over `TraceStages`, an executor that runs no target but reads what the target would choose from its cached greedy
trace (spd.eval.fast.GreedyTrace). The loop, the schedule, the drafter, every prune and flush are the runtime's; only
the stages are replaced, so the replay's steps, acceptances and tokens are the runtime's wherever the pipeline's
forwards choose the trace's tokens (their near-ties are counted, as for the other replays).

A node's logits choose the trace's next token when its path from the verified context is the trace's; a node off
the trace is never a frontier (only verified nodes are), so what it would choose is never read.
"""

from __future__ import annotations

import torch

from spd.decoding import Request
from spd.eval.fast import GreedyTrace
from spd.runtime.executor import StageExecutor, StepOutput
from spd.runtime.pipeline import PipelineDecoder
from spd.runtime.segments import SegmentPipelineDecoder

OFF_TRACE = -1    # an exiting node off the trace: a token no child can be


class TraceStages(StageExecutor):
    trees = True
    segments = True

    def __init__(self, trace: GreedyTrace, n: int, vocab: int):
        self.sequence = list(trace.prompt_ids) + list(trace.tokens)
        self.prompt = len(trace.prompt_ids)
        self.margins = trace.margins            # margins[i]: the target's when it chose tokens[i]
        self.n, self.vocab = n, vocab
        self.bounds = list(range(n + 1))
        self.device = torch.device("cpu")

    def embed(self, token: int) -> torch.Tensor:
        return torch.zeros(1, 1, 1)

    def _chosen(self, pos: int) -> tuple[int, float]:
        """The trace's token after position `pos` and the margin it was chosen by."""
        i = pos + 1 - self.prompt
        return self.sequence[pos + 1], self.margins[i]

    def _rows(self, chosen: list[tuple[int, float] | None]) -> torch.Tensor:
        """Logits [k, V] whose argmax is each chosen token, with the trace's top-2 margin there (a drafter that
        prices with the margin reads it); zeros off the trace."""
        rows = torch.zeros(len(chosen), self.vocab)
        for i, c in enumerate(chosen):
            if c is not None:
                rows[i, c[0]] = max(c[1], 1e-6)
        return rows

    def prefill(self, prompt_ids, capture, max_length=None, argmax_exit=False):
        if list(prompt_ids) != self.sequence[: self.prompt]:
            raise ValueError("the trace was recorded for another prompt")
        self.argmax = argmax_exit
        return self._rows([self._chosen(self.prompt - 1)])[0], {}

    def launch(self, step, entering, flight=None):
        out = StepOutput()
        if step.runs(self.n - 1):
            nodes = flight.level(step.work[-1])
            chosen = []
            for node in nodes:
                branch = flight.branch(node)
                on = all(flight.nodes[a].pos < len(self.sequence) and
                         flight.token(a) == self.sequence[flight.nodes[a].pos] for a in branch)
                pos = flight.nodes[node].pos
                chosen.append(self._chosen(pos) if on and pos + 1 < len(self.sequence) else None)
            out.exit_nodes = list(nodes)
            if self.argmax:
                tokens = [OFF_TRACE if c is None else c[0] for c in chosen]
                out.exit_argmax = tokens[0] if len(tokens) == 1 else tokens
            else:
                rows = self._rows(chosen)
                out.exit_logits = rows[0] if len(nodes) == 1 else rows
        self._out = out

    def collect(self) -> StepOutput:
        return self._out

    def rollback(self, length: int) -> None:
        """Nothing is cached."""

    def prune(self, flight) -> None:
        """Nothing is cached."""


def replay(decoder, trace: GreedyTrace) -> dict:
    out = decoder.generate(list(trace.prompt_ids), Request(len(trace.tokens)))
    if out.token_ids != list(trace.tokens):
        raise AssertionError("the replay left the trace: its stages must choose the trace's tokens")
    return {"stats": out.stats, "min_target_margin": min(trace.margins) if trace.margins else None}


def fast_segment_eval(trace: GreedyTrace, *, make_drafter, n: int, segment: int, draft_length: int, width: int,
                      tree_nodes: int, vocab: int) -> dict:
    """FlowSpec's exact greedy replay (spd.methods): its segments over the trace."""
    stages = TraceStages(trace, n, vocab)
    return replay(SegmentPipelineDecoder(stages, make_drafter(), frozenset(), segment, draft_length, width,
                                         tree_nodes), trace)


def fast_pipedec_eval(trace: GreedyTrace, *, make_drafter, n: int, width: int, children: int | None,
                      vocab: int) -> dict:
    """PipeDec's exact greedy replay (spd.methods): its draft model runs, the target's stages are read from the
    trace."""
    stages = TraceStages(trace, n, vocab)
    return replay(PipelineDecoder(stages, make_drafter(), frozenset(), width, children, spine=False), trace)
