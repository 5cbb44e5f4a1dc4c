"""One sequence's part of a multi-process pipeline that decodes several (SEED's schedule, spd.runtime.seed): its
state on the controller's side (`Slot`; its index names its caches in every stage process) and its executor
(`SlotStages`), whose calls go to the controller (`DistributedStages`), which sends every sequence's step at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from spd.runtime.executor import StageExecutor, StepOutput
from spd.runtime.flight import Flight
from spd.verify.tree_rows import StageRows
from spd.runtime.schedule import Step

if TYPE_CHECKING:
    from spd.runtime.distributed.controller import DistributedStages


def chain_flight(step: Step) -> Flight:
    """A chain's flight for a step (one node per position, ids = positions): what a call without one runs."""
    return Flight.restore(1, [(pos, pos, pos - 1) for pos, _ in step.in_flight()])


@dataclass(eq=False)
class Slot:
    """One sequence's state on the controller's side; `index` names its caches in every stage process."""
    index: int
    active: bool = False            # prefilled and not yet ended
    crop: int = -1                  # a rollback's length, sent with the slot's next row (-1: none)
    capture_on: bool = False
    argmax: bool = False
    cache: object = None            # a hosted stage 0's KV cache of the sequence
    rows0: StageRows | None = None  # and its rows
    step: Step | None = None        # the step queued or in flight
    flight: Flight | None = None
    entering: torch.Tensor | None = None
    probe: bool = False
    levels: dict[int, list[int]] = field(default_factory=dict)   # stage -> the nodes it runs this step
    out: StepOutput | None = None


class SlotStages(StageExecutor):
    """One sequence's executor in a pipeline that decodes several (SEED's schedule): its launches wait for the
    pipeline's `run`, which sends every sequence's step at once."""

    trees = True
    shared = True

    def __init__(self, pipeline: "DistributedStages", slot: Slot):
        self.pipeline, self.slot = pipeline, slot
        self.n, self.bounds, self.device = pipeline.n, pipeline.bounds, pipeline.device

    def embed(self, token: int) -> torch.Tensor:
        return self.pipeline.embed(token)

    def prefill(self, prompt_ids, capture, max_length=None, argmax_exit=False):
        return self.pipeline.prefill_slot(self.slot, prompt_ids, capture, max_length, argmax_exit)

    def launch(self, step: Step, entering, flight: Flight | None = None):
        self.pipeline.queue(self.slot, step, entering, flight or chain_flight(step))

    def collect(self) -> StepOutput:
        self.pipeline.gather()
        return self.slot.out

    def rollback(self, length):
        self.pipeline.rollback_slot(self.slot, length)

    def prune(self, flight: Flight):
        self.pipeline.prune_slot(self.slot, flight)

    def finish(self) -> None:
        self.pipeline.release(self.slot)
