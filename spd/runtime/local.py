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
from spd.verify.tree_rows import StageRows
from spd.runtime.schedule import Step
from spd.targets.stages import StagedTarget


class LocalStages(StageExecutor):
    trees = True
    segments = True

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

    def _run_tree(self, stage: int, hidden: torch.Tensor, positions: list[int], visible):
        """One stage on a tree level's or a segment's nodes [1, k, d] at their positions under `level_mask`'s mask;
        the last stage gives every node's logits [k, V]."""
        positions = torch.tensor(positions, device=self.device)
        out, captured = self.target.run_layers(hidden, positions, self.bounds[stage], self.bounds[stage + 1],
                                               self.cache, self.capture, visible=visible)
        if stage < self.n - 1:
            return out, captured, None
        return out, captured, self.target.logits(out[0] if len(positions) > 1 else out[0, -1])

    def launch(self, step: Step, entering, flight: Flight | None = None):
        out = StepOutput()
        for stage, key in enumerate(step.work):
            if not step.runs(stage):
                continue
            # the stage's inputs are made on its own stream (runtime=streams): made on the caller's, after the
            # stage's stream was told to wait for it, they could be read before they are written
            with self._stream(stage):
                nodes, positions, hidden, visible = self._inputs(stage, key, entering, flight)
                if visible is None:
                    hidden, captured, logits = self._run(stage, hidden, positions[0])
                else:
                    hidden, captured, logits = self._run_tree(stage, hidden, positions, visible)
            self._outputs(stage, positions, nodes, hidden, captured, logits, out)
        self._out = out

    def _inputs(self, stage: int, key: int, entering, flight: Flight | None):
        """What `stage` runs for the schedule's `key` (a position, or a segment: `flight.level` knows): (its nodes,
        their positions, their residual streams [1, k, d], level_mask's mask or None)."""
        nodes = [key] if flight is None else flight.level(key)
        positions = [key] if flight is None else [flight.nodes[node].pos for node in nodes]
        if flight is not None:
            self.rows[stage].fold(flight)
        hidden = entering if stage == 0 else torch.cat([self.hidden.pop(node) for node in nodes], 1)
        visible = None if flight is None else level_mask(self.rows[stage], nodes, flight, self.device)
        return nodes, positions, hidden, visible

    def _outputs(self, stage: int, positions: list[int], nodes: list[int], hidden, captured, logits,
                 out: StepOutput) -> None:
        """Book what `stage` made for `nodes`: states for the next stage, the drafter's features, the exit logits."""
        self.rows[stage].append(nodes, positions)
        for i, node in enumerate(nodes):
            out.features[node] = {layer: h[:, i: i + 1] for layer, h in captured.items()}
            if logits is None:
                self.hidden[node] = hidden[:, i: i + 1]
        if logits is not None:                   # what leaves the pipeline, with its logits
            out.exit_nodes = list(nodes)
            out.exit_logits = logits if len(nodes) > 1 else logits.reshape(-1, logits.shape[-1])[-1]
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
