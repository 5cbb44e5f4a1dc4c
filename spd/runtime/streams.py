"""Executors whose stage steps have fixed shapes: `GraphStages` (CUDA graphs, stages one after another) and
`StreamStages` (`runtime=streams`: every stage on its own CUDA stream, launched together, one wait per step).

Both keep one static cache across generations (a prefill empties it; a rollback changes lengths only), so the
graphs captured on its buffers stay valid. In a step every stage works on a different position and reads only what
the previous step produced, so the stages are independent and may overlap on one GPU; the drafter runs meanwhile on
the caller's stream. The schedule, verification and rollback are the decoding loop's (`spd.runtime.pipeline`);
these classes only say where and how a stage runs. Off CUDA there are no graphs and no streams and the same code
runs eagerly, one stage after another: what the CPU tests check against `LocalStages`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from spd.decoding import prefill
from spd.runtime.local import LocalStages
from spd.verify.tree_rows import StageRows
from spd.runtime.schedule import Step
from spd.runtime.executor import StepOutput
from spd.targets.fixed_step import FixedStep
from spd.targets.stages import StagedTarget


class GraphStages(LocalStages):
    """A level of one node that sees every cached row (a chain's step) runs the stage's fixed-shape step; a tree
    level (W > 1: several nodes, or one that must not see a pruned sibling's rows) runs eagerly under its mask
    (`LocalStages._run_tree`) into the same static cache, outside any graph: one fixed-shape step per width and mask
    is not built."""

    def __init__(self, target: StagedTarget, cuda_graphs: bool = True):
        super().__init__(target)
        self.cuda_graphs = cuda_graphs
        self.cache = None
        self.steps: list[FixedStep] = []

    def prefill(self, prompt_ids, capture, max_length=None, argmax_exit=False):
        if max_length is None:
            raise ValueError("fixed-shape stages need the context length (a static cache)")
        self.capture = frozenset(capture)
        cache, hidden, captured = prefill(self.target, prompt_ids, self.capture, max_length, self.cache)
        if cache is not self.cache or any(step.capture != self.capture for step in self.steps):
            self.cache = cache             # a longer context or other layers to capture: new steps, new graphs
            b = self.bounds
            self.steps = [FixedStep(self.target, b[s], b[s + 1], cache, self.capture, logits=s == self.n - 1,
                                    cuda_graph=self.cuda_graphs) for s in range(self.n)]
        self.hidden = {}
        self.rows = [StageRows(len(prompt_ids)) for _ in range(self.n)]
        return self.target.logits(hidden[0, -1]), captured

    def _run(self, stage: int, hidden: torch.Tensor, pos: int):
        return self.steps[stage](hidden, pos)


class StreamStages(GraphStages):
    """Each stage's step on its own CUDA stream; the caller's stream (the drafter's) waits for all of them once,
    in `collect`."""

    def __init__(self, target: StagedTarget, cuda_graphs: bool = True):
        super().__init__(target, cuda_graphs)
        on_cuda = target.device.type == "cuda"
        self.streams = [torch.cuda.Stream(device=target.device) for _ in range(self.n)] if on_cuda else None

    def _stream(self, stage: int):
        return nullcontext() if self.streams is None else torch.cuda.stream(self.streams[stage])

    def launch(self, step: Step, entering, flight=None):
        if self.streams is None:
            return super().launch(step, entering, flight)
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams:              # the entering embedding, the drafter's reads, a rollback's crop
            stream.wait_stream(caller)
        if entering is not None:
            entering.record_stream(self.streams[0])
        super().launch(step, entering, flight)

    def _handoff(self, stage, nodes, out):
        if self.streams is None:
            return
        # a tensor made on one stream and read on another must not be handed out again by the allocator before
        # that read: features and exiting logits are read on the caller's stream, a hidden state by the next stage
        caller = torch.cuda.current_stream(self.device)
        for node in nodes:
            for h in out.features.get(node, {}).values():
                h.record_stream(caller)
            if node in self.hidden:
                self.hidden[node].record_stream(self.streams[stage + 1])
        if out.exit_logits is not None:
            out.exit_logits.record_stream(caller)

    def collect(self) -> StepOutput:
        if self.streams is not None:
            caller = torch.cuda.current_stream(self.device)
            for stream in self.streams:
                caller.wait_stream(stream)
        return super().collect()
