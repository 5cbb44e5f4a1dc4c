"""Several sequences in one SPD pipeline (SEED's scheduled speculation, paper 003, adapted to a pipelined target).

Each sequence is an ordinary `PipelineDecoder` — its own drafter, schedule, flight, caches, sampling, seed and
statistics — over a `SequenceStages`, its view of the shared stages: a launch prepares the sequence's rows for every
stage that runs (the same inputs `LocalStages` makes) and hands them to the `StageHub` instead of running them. Once
every sequence has launched its step, the hub runs each stage once over the rows of all of them (a ragged forward,
spd.targets.ragged: one matrix product per layer, attention per sequence), and each sequence collects, verifies and
rolls back on its own. So a stage advances every sequence that has a position at it: after one sequence's rollback
its stages 2..n would sit idle until its correction refills them, and the other sequences' rows run there instead.

Across processes (runtime=distributed) the stage processes are the hub: each sequence holds a slot, a step's
control message carries a row per slot, every stage process keeps a cache per slot and runs all the slots' rows at
its stage in one forward (spd.runtime.distributed). There the stages run while the controller drafts for every
sequence, as a solo pipeline's do.

Where this differs from SEED (§4.2 of its paper): SEED's drafters run in parallel and a single target verifies the
drafts of one sequence at a time, in FCFS order of the queue of finished drafts (its "rounds"); here every ready
sequence is verified in the same pipeline step, so there is no verification queue to order — FCFS governs admission
(`max_batch` running, the rest waiting in arrival order) and a round is one pipeline step of every running sequence.
Verifying one sequence at a time would leave the stages' matrix products at one row, which is what batching buys on
these CPUs (design §9).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from spd.decoding import Request
from spd.drafters.base import Drafter, propose_together
from spd.runtime.batch import ManySequences, Ticket
from spd.runtime.executor import StageExecutor, StepOutput
from spd.runtime.flight import Flight
from spd.runtime.local import LocalStages
from spd.runtime.pipeline import SHARED_STEP, DraftWanted, PipelineDecoder
from spd.runtime.schedule import Step
from spd.targets.ragged import Segment, exit_logits, run_rows
from spd.targets.row_costs import use_machine_products
from spd.targets.stages import StagedTarget


@dataclass
class Work:
    """One sequence's rows at one stage in this step."""
    stages: "SequenceStages"
    stage: int
    positions: list[int]                  # each node's
    nodes: list[int]
    hidden: torch.Tensor                  # [1, k, d] entering the stage
    visible: tuple | None                 # a tree level's mask (level_mask), None for a chain's one row


class StageHub:
    """The stages every sequence shares, in this process: collects each sequence's work of a step, runs it stage by
    stage. (runtime=distributed: `DistributedStages` plays this part, its stage processes holding every sequence.)"""

    def __init__(self, target: StagedTarget):
        self.target = target
        use_machine_products(target)      # the stages' few rows, multiplied the faster way here
        self.works: list[Work] = []
        self.forwards = 0                 # stage forwards run, and the rows they carried
        self.rows = 0
        self.most = 0                     # the most sequences one step carried

    def sequence(self) -> "SequenceStages":
        return SequenceStages(self.target, self)

    def discard(self, stages: "SequenceStages") -> None:
        self.works = [w for w in self.works if w.stages is not stages]

    @torch.no_grad()
    def run(self) -> None:
        target, works, self.works = self.target, self.works, []
        self.most = max(self.most, len({id(w.stages) for w in works}))
        for stage in sorted({w.stage for w in works}):
            group = [w for w in works if w.stage == stage]
            segments = [Segment(w.stages.cache, w.positions, w.visible) for w in group]
            capture = frozenset().union(*(w.stages.capture for w in group))
            hidden = torch.cat([w.hidden for w in group], 1)
            start, end = target.bounds[stage], target.bounds[stage + 1]
            out, captured, bounds = run_rows(target, hidden, segments, start, end, capture)
            # every sequence's exiting token, one head product
            exits = exit_logits(target, out, bounds) if stage == target.n - 1 else [None] * len(group)
            self.forwards += 1
            self.rows += bounds[-1]
            for w, lo, hi, logits in zip(group, bounds, bounds[1:], exits):
                own = {layer: captured[layer][:, lo:hi] for layer in w.stages.capture if layer in captured}
                w.stages._outputs(stage, w.positions, w.nodes, out[:, lo:hi], own, logits, w.stages._out)


class SequenceStages(LocalStages):
    """One sequence's stages in a shared pipeline: its own cache and rows; its launches run in the hub."""
    shared = True

    def __init__(self, target: StagedTarget, hub: StageHub):
        super().__init__(target)
        self.hub = hub

    def launch(self, step: Step, entering, flight: Flight | None = None):
        self._out = StepOutput()
        for stage, key in enumerate(step.work):
            if step.runs(stage):
                nodes, positions, hidden, visible = self._inputs(stage, key, entering, flight)
                self.hub.works.append(Work(self, stage, positions, nodes, hidden, visible))

    def finish(self) -> None:
        """The sequence ended (or was cancelled): its work leaves the hub, its memory goes."""
        self.hub.discard(self)
        self.cache = None


class SeedDecoder(ManySequences):
    """Up to `max_batch` requests in one SPD pipeline, FIFO admission, each decoding as it would alone. stages: the
    target, staged in this process, or the stage processes' controller (runtime=distributed, `Setup.slots` >=
    max_batch)."""

    def __init__(self, stages: StagedTarget | StageExecutor, new_drafter: Callable[[], Drafter],
                 eos_ids: frozenset[int], width: int = 1, max_batch: int = 4, children: int | None = None,
                 spine: bool = True):
        """width, children, spine: each sequence's tree (PipelineDecoder's)."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.hub = StageHub(stages) if isinstance(stages, StagedTarget) else stages
        if max_batch > getattr(self.hub, "capacity", max_batch):
            raise ValueError(f"max_batch={max_batch} exceeds the {self.hub.capacity} sequences the stages were set "
                             "up for")
        self.new_drafter, self.eos_ids = new_drafter, eos_ids
        self.width, self.max_batch, self.children, self.spine = width, max_batch, children, spine
        self.waiting: deque[Ticket] = deque()
        self.running: list[Ticket] = []
        self.streams: dict[Ticket, object] = {}

    def submit(self, prompt_ids: list[int], request: Request, on_tokens=None) -> Ticket:
        ticket = Ticket(list(prompt_ids), request, on_tokens=on_tokens)
        self.waiting.append(ticket)
        return ticket

    def _advance(self, ticket: Ticket, proposal=None):
        """Run the sequence (sending it `proposal`, the draft it asked for) until its next step is launched or it
        wants its draft (returned, a DraftWanted), or it ends; deliver the tokens it settles meanwhile."""
        tokens, stream = [], self.streams[ticket]
        item = None
        try:
            item = next(stream) if proposal is None else stream.send(proposal)
            while item is not SHARED_STEP and not isinstance(item, DraftWanted):
                tokens.append(item)
                item = next(stream)
        except StopIteration:
            item = None
        if tokens:
            if ticket.first_token_at is None:
                ticket.first_token_at = time.perf_counter()
            ticket.tokens.extend(tokens)
            if ticket.on_tokens:
                ticket.on_tokens(ticket, tokens)
        if item is None:
            self._finish(ticket, "stop" if ticket.tokens and ticket.tokens[-1] in self.eos_ids else "length")
        return item

    def _finish(self, ticket: Ticket, reason: str) -> None:
        ticket.finish, ticket.finished_at = reason, time.perf_counter()
        stream = self.streams.pop(ticket, None)
        if stream is not None:
            stream.close()                   # a cancelled one: its executor's finish frees its memory and work

    def abandon(self) -> None:
        for ticket in self.running:
            stream = self.streams.pop(ticket, None)
            if stream is not None:
                try:
                    stream.close()           # each executor's finish: its queued work and memory go
                except Exception:            # noqa: BLE001 - the stages that failed may fail this too
                    pass
        self.streams.clear()
        super().abandon()

    def step(self) -> None:
        """One pipeline step of every running sequence; then the finished and cancelled leave, the waiting join."""
        self.hub.run()
        wanted: dict[Ticket, DraftWanted] = {}
        for ticket in self.running:
            if ticket._cancel:
                self._finish(ticket, "cancelled")
            elif isinstance(item := self._advance(ticket), DraftWanted):
                wanted[ticket] = item
        asks = list(wanted.values())
        drafted = propose_together([w.drafter for w in asks], [w.view for w in asks], [w.propose for w in asks])
        for ticket, proposal in zip(wanted, drafted):
            self._advance(ticket, proposal)
        self.running = [t for t in self.running if not t.done]
        while self.waiting and len(self.running) < self.max_batch:
            ticket = self.waiting.popleft()
            if ticket._cancel:
                ticket.finish, ticket.finished_at = "cancelled", time.perf_counter()
                continue
            ticket.started_at = time.perf_counter()
            ticket.sequence = PipelineDecoder(self.hub.sequence(), self.new_drafter(), self.eos_ids, self.width,
                                              self.children, self.spine)
            self.streams[ticket] = ticket.sequence.stream(ticket.prompt_ids, ticket.request)
            self._advance(ticket)                              # prefill, the first token, the first step launched
            if not ticket.done:
                self.running.append(ticket)
