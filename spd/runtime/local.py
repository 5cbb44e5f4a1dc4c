"""The in-process executor: every stage runs in this process, one after another, on the same device.

It is the reference (and the oracle for every other executor's tests): the same schedule, the same stage runner,
but no concurrency, so wall-clock numbers from it are not SPD's.
"""

from __future__ import annotations

import torch

from spd.decoding import prefill
from spd.runtime.executor import StageExecutor, StepOutput
from spd.runtime.schedule import Step
from spd.target.stages import StagedTarget


class LocalStages(StageExecutor):
    def __init__(self, target: StagedTarget):
        self.target = target
        self.n = target.n
        self.bounds = target.bounds
        self.device = target.device

    def embed(self, token: int) -> torch.Tensor:
        return self.target.embed(torch.tensor([[token]], device=self.device))

    def prefill(self, prompt_ids, capture, max_length=None):
        self.capture = frozenset(capture)
        self.cache, hidden, captured = prefill(self.target, prompt_ids, self.capture, max_length)
        self.hidden: dict[int, torch.Tensor] = {}     # pos -> residual stream [1, 1, d] entering its next stage
        return self.target.logits(hidden[0, -1]), captured

    def launch(self, step: Step, entering):
        out = StepOutput()
        for stage, pos in enumerate(step.work):
            if not step.runs(stage):
                continue
            hidden = entering if stage == 0 else self.hidden.pop(pos)
            positions = torch.tensor([pos], device=self.device)
            self.hidden[pos], captured = self.target.run_stage(stage, hidden, positions, self.cache, self.capture)
            out.features[pos] = captured
        if step.exiting is not None:
            out.exit_logits = self.target.logits(self.hidden.pop(step.exiting)[0, -1])
        self._out = out

    def collect(self) -> StepOutput:
        out, self._out = self._out, None
        return out

    def rollback(self, length):
        self.cache.crop(length)
        self.hidden = {pos: h for pos, h in self.hidden.items() if pos < length}
