"""The in-process executor: every stage runs in this process, one after another, on the same device.

It is the reference (and the oracle for every other executor's tests): the same schedule, the same stage runner,
but no concurrency, so wall-clock numbers from it are not SPD's.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from spd.decoding import prefill
from spd.runtime.executor import StageExecutor, StepOutput, level_mask
from spd.runtime.flight import Flight
from spd.tree_rows import StageRows
from spd.runtime.schedule import Step
from spd.targets.stages import StagedTarget


class LocalStages(StageExecutor):
    trees = True

    def __init__(self, target: StagedTarget):
        self.target = target
        self.n = target.n
        self.bounds = target.bounds
        self.device = target.device

    def embed(self, token: int) -> torch.Tensor:
        # a fill, not a host-to-device copy: nothing waits for the stages still running on their streams
        return self.target.embed(torch.full((1, 1), token, dtype=torch.long, device=self.device))

    def prefill(self, prompt_ids, capture, max_length=None, argmax_exit=False):
        self.capture = frozenset(capture)
        self.cache, hidden, captured = prefill(self.target, prompt_ids, self.capture, max_length)
        self.hidden: dict[int, torch.Tensor] = {}     # node -> residual stream [1, 1, d] entering its next stage
        self.rows = [StageRows(len(prompt_ids)) for _ in range(self.n)]
        return self.target.logits(hidden[0, -1]), captured

    def _run(self, stage: int, hidden: torch.Tensor, pos: int):
        """One stage on one position -> (its output [1, 1, d], {l: H^l}, the target's logits [V] if it was the last
        stage, else None)."""
        out, captured = self.target.run_stage(stage, hidden, torch.tensor([pos], device=self.device), self.cache,
                                              self.capture)
        return out, captured, self.target.logits(out[0, -1]) if stage == self.n - 1 else None

    def _stream(self, stage: int):
        return nullcontext()

    def _run_tree(self, stage: int, hidden: torch.Tensor, pos: int, visible):
        """One stage on a tree level's nodes [1, k, d] under `level_mask`'s mask."""
        positions = torch.full((hidden.shape[1],), pos, device=self.device)
        out, captured = self.target.run_layers(hidden, positions, self.bounds[stage], self.bounds[stage + 1],
                                               self.cache, self.capture, visible=visible)
        return out, captured, self.target.logits(out[0, -1]) if stage == self.n - 1 else None

    def launch(self, step: Step, entering, flight: Flight | None = None):
        out = StepOutput()
        for stage, pos in enumerate(step.work):
            if not step.runs(stage):
                continue
            # the stage's inputs are made on its own stream (runtime=streams): made on the caller's, after the
            # stage's stream was told to wait for it, they could be read before they are written
            with self._stream(stage):
                nodes, hidden, visible = self._inputs(stage, pos, entering, flight)
                if visible is None:
                    hidden, captured, logits = self._run(stage, hidden, pos)
                else:
                    hidden, captured, logits = self._run_tree(stage, hidden, pos, visible)
            self._outputs(stage, pos, nodes, hidden, captured, logits, out)
        self._out = out

    def _inputs(self, stage: int, pos: int, entering, flight: Flight | None):
        """What `stage` runs at `pos`: (its nodes, their residual streams [1, k, d], level_mask's mask or None)."""
        nodes = [pos] if flight is None else flight.level(pos)
        if flight is not None:
            self.rows[stage].fold(flight)
        hidden = entering if stage == 0 else torch.cat([self.hidden.pop(node) for node in nodes], 1)
        visible = None if flight is None else level_mask(self.rows[stage], nodes, flight, self.device)
        return nodes, hidden, visible

    def _outputs(self, stage: int, pos: int, nodes: list[int], hidden, captured, logits, out: StepOutput) -> None:
        """Book what `stage` made for `nodes`: states for the next stage, the drafter's features, the exit logits."""
        self.rows[stage].append(nodes, pos)
        for i, node in enumerate(nodes):
            out.features[node] = {layer: h[:, i: i + 1] for layer, h in captured.items()}
            if logits is None:
                self.hidden[node] = hidden[:, i: i + 1]
        if logits is not None:                   # step.exiting: it leaves the pipeline with its logits
            assert len(nodes) == 1, "the oldest level in flight is one verified node"
            out.exit_logits = logits
        self._handoff(stage, nodes, out)

    def _handoff(self, stage: int, nodes: list[int], out: StepOutput) -> None:
        """`stage` just ran `nodes` (keyed by node id, as `out.features` and `self.hidden` are): where stages run on
        streams of their own, what it made is marked as read by the streams that read it."""

    def collect(self) -> StepOutput:
        out, self._out = self._out, None
        return out

    def rollback(self, length):
        self.cache.crop(length)
        for rows in self.rows:
            rows.crop(length)
        self.hidden = {}        # every state between stages belonged to a position >= length

    def prune(self, flight: Flight):
        for stage, rows in enumerate(self.rows):
            moved = rows.prune(flight)
            if moved is not None:
                self.cache.keep(*moved, layers=range(self.bounds[stage], self.bounds[stage + 1]))
        self.hidden = {node: h for node, h in self.hidden.items() if node in flight.nodes}
