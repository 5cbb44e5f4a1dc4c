"""The in-process executor: every stage runs in this process, one after another, on the same device.

It is the reference (and the oracle for every other executor's tests): the same schedule, the same stage runner,
but no concurrency, so wall-clock numbers from it are not SPD's.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from spd.decoding import prefill
from spd.runtime.executor import StageExecutor, StepOutput
from spd.runtime.schedule import Step
from spd.targets.stages import StagedTarget


class LocalStages(StageExecutor):
    def __init__(self, target: StagedTarget):
        self.target = target
        self.n = target.n
        self.bounds = target.bounds
        self.device = target.device

    def embed(self, token: int) -> torch.Tensor:
        return self.target.embed(torch.tensor([[token]], device=self.device))

    def prefill(self, prompt_ids, capture, max_length=None, argmax_exit=False):
        self.capture = frozenset(capture)
        self.cache, hidden, captured = prefill(self.target, prompt_ids, self.capture, max_length)
        self.hidden: dict[int, torch.Tensor] = {}     # pos -> residual stream [1, 1, d] entering its next stage
        return self.target.logits(hidden[0, -1]), captured

    def _run(self, stage: int, hidden: torch.Tensor, pos: int):
        """One stage on one position -> (its output [1, 1, d], {l: H^l}, the target's logits [V] if it was the last
        stage, else None)."""
        out, captured = self.target.run_stage(stage, hidden, torch.tensor([pos], device=self.device), self.cache,
                                              self.capture)
        return out, captured, self.target.logits(out[0, -1]) if stage == self.n - 1 else None

    def _stream(self, stage: int):
        return nullcontext()

    def launch(self, step: Step, entering):
        out = StepOutput()
        for stage, pos in enumerate(step.work):
            if not step.runs(stage):
                continue
            hidden = entering if stage == 0 else self.hidden.pop(pos)
            with self._stream(stage):
                hidden, out.features[pos], logits = self._run(stage, hidden, pos)
            if logits is None:
                self.hidden[pos] = hidden
            else:                                   # step.exiting: it leaves the pipeline with its logits
                out.exit_logits = logits
        self._out = out

    def collect(self) -> StepOutput:
        out, self._out = self._out, None
        return out

    def rollback(self, length):
        self.cache.crop(length)
        self.hidden = {pos: h for pos, h in self.hidden.items() if pos < length}
