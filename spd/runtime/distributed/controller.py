"""The controller's side of the multi-process pipeline (rank 0): a `StageExecutor` whose stages are processes.

Placement, by measured cost on SmolLM2 (docs/speed-cpu.md, "Concurrent stages"): the 49,152-row LM head costs about as much as 8 decoder
layers on a CPU core, more than the module's draft. It sits on the last stage, where `stage_bounds=balanced` can
give that stage fewer layers to pay for it; on the controller it would run *after* the step, serially, every step.
Verification stays on the controller: it needs the draft's q and the sampling generator, costs ~30 µs, and keeps
every random draw in the same order as `runtime=local`, so seeded sampling gives the same tokens. When greedy, the
last stage sends only the argmax (verification needs nothing else) instead of a [V] row per step.

A hosted controller (`Setup.hosted`) also runs stage 0, so n stages take n processes: on a CPU with as many cores
as stages, a separate controller would be one busy process too many. Stage 0 then runs at `launch`, before the
drafter; `stage_bounds=balanced` gives it fewer layers for the controller's share of the step.

Several sequences (SEED's schedule, spd.runtime.seed): each holds a slot (`sequence()` hands out a `SlotStages`,
its executor); their launches queue, `run()` sends one step message for all of them, and the first `collect` after it
receives every stage's payload and splits it per slot. `DistributedStages` itself is the executor of one sequence
decoded alone, in slot 0.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from spd.runtime.distributed import comm
from spd.runtime.distributed.placement import on_wire
from spd.runtime.distributed.protocol import (ABORT, END, MAX_ARGMAX_VOCAB, PREFILL, PROBE, STEP, STOP, TAG_CONTROL,
                                              TAG_HIDDEN, TAG_PAYLOAD, TAG_PREFILL, TAG_READY, Setup, control,
                                              first_remote, message, rank_of, stage_capture, stage_layers,
                                              world_size)
from spd.runtime.executor import StageExecutor, StepOutput, level_mask
from spd.runtime.distributed.slots import Slot, SlotStages, chain_flight
from spd.runtime.flight import Flight
from spd.verify.tree_rows import StageRows
from spd.runtime.schedule import Step, first_step, next_step
from spd.targets.ragged import Segment, run_rows
from spd.targets.stages import StagedTarget
from spd.targets.weight_cache import load_parts


class DistributedStages(StageExecutor):
    """target: the controller's parts of the target (embedding; the layers are in the stage processes, stage 0's in
    this one when it hosts it)."""

    trees = True
    segments = True

    def __init__(self, target: StagedTarget, setup: Setup, processes=None, load_timeout_s: float = 600.0):
        self.target = target
        self.setup = setup
        self.processes = processes          # the local stage processes when this controller spawned them
        self.n = setup.n
        self.bounds = setup.bounds
        self.device = target.device
        self.dtype = target.dtype  # once: StagedTarget.dtype searches the parameters for a materialised one
        self.wire = on_wire(self.device, self.dtype, setup.nccl)
        self.payload_wire = on_wire(self.device, torch.float32, setup.nccl)   # float32: greedy exits' argmax
        self.d = target.config.hidden_size
        self.vocab = target.config.vocab_size
        self.timeout = setup.step_timeout_s
        self.capture_of = [stage_capture(setup.capture, setup.bounds, s) for s in range(self.n)]
        self.hosted = setup.hosted
        self.remote = range(first_remote(setup.hosted), self.n)   # the stages that run in stage processes
        self.world = world_size(self.n, self.hosted)               # processes in all, this one included
        self.capacity = setup.slots
        self.solo = Slot(0)                 # a sequence decoded alone (this object as its executor)
        self.held: set[int] = set()         # slots of the sequences decoding together (`sequence()`)
        self.queued: list[Slot] = []
        self.waiting: list[tuple[int, comm.Pending, list[Slot]]] = []   # payloads of the step in flight
        self.steps = 0                      # step messages sent, and the most sequences one of them carried
        self.most = 0
        self.sends = []
        self.closed = False
        dist.broadcast_object_list([setup], src=0)
        if self.hosted:  # while the stage processes load theirs
            parts = load_parts(setup.cache_dir, stage_layers(setup.bounds, 0), embed=False, head=False,
                               dtype=self.dtype, device=self.device, weights=setup.weights)
            self.stage0 = StagedTarget(parts.model, self.n, setup.bounds)
        for s in self.remote:
            comm.recv(1, torch.float32, rank_of(s, self.hosted), TAG_READY, load_timeout_s,
                      self._what(s, "loading its layers"))

    def _what(self, stage: int, action: str) -> str:
        return f"stage {stage + 1}/{self.n} (rank {rank_of(stage, self.hosted)}) {action}"

    def _fail(self, exc: comm.PipelineFailure):
        """Name the dead process when we spawned it: more useful than the socket error it caused."""
        if self.processes is not None:
            if self.processes.interrupted():  # Ctrl-C reached the stages first: the user's interrupt, not a fault
                raise KeyboardInterrupt
            dead = self.processes.describe_failure()
            if dead:
                raise comm.PipelineFailure(dead) from None
        raise exc

    def _flush_sends(self) -> None:
        try:
            for work in self.sends:
                comm.wait(work, self.timeout, "sending to the stages")
        except comm.PipelineFailure as exc:
            self._fail(exc)
        self.sends = []

    def _command(self, rows: dict[int, torch.Tensor]) -> None:
        """One control message (slot -> its row) to every stage process, after the step in flight is received."""
        self.gather()
        self._flush_sends()
        msg = message(rows, self.n, self.setup.width, self.capacity)
        try:
            for s in self.remote:
                self.sends.append(comm.send(msg, rank_of(s, self.hosted), TAG_CONTROL))
        except comm.PipelineFailure as exc:
            self._fail(exc)

    def _row(self, cmd: int, **fields) -> torch.Tensor:
        return control(cmd, self.n, self.setup.width, **fields)

    def _payload_size(self, stage: int, length: int, capture: bool, argmax: bool = False,
                      exiting: int | None = None) -> int:
        """Floats `stage` sends for `length` rows: their captured features, and from the last stage the logits (or
        argmax) of the `exiting` rows (None: all of them, a step's; a prefill's: its last)."""
        rows = len(self.capture_of[stage]) * length * self.d if capture else 0
        exiting = length if exiting is None else exiting
        return rows + ((1 if argmax else self.vocab) * exiting if stage == self.n - 1 else 0)

    def _unpack(self, stage: int, flat: torch.Tensor, length: int, capture: bool, sink: dict) -> torch.Tensor | None:
        """Feature rows into sink {layer: [1, length, d]}; returns what the last stage sent of the exiting token
        (logits [V], or its argmax [1])."""
        offset = 0
        for layer in (self.capture_of[stage] if capture else []):
            size = length * self.d
            sink[layer] = flat[offset: offset + size].view(1, length, self.d).to(self.device, self.dtype)
            offset += size
        return flat[offset:].to(self.device) if stage == self.n - 1 else None

    # ---------------------------------------------------------------- one sequence's part
    def prefill_slot(self, slot: Slot, prompt_ids, capture, max_length=None, argmax_exit=False):
        slot.crop = -1
        slot.capture_on = bool(capture)
        if slot.capture_on and not set(capture) - {0} <= set(self.setup.capture):
            raise ValueError(f"capture {sorted(capture)} was not announced at setup ({self.setup.capture})")
        slot.argmax = argmax_exit and self.vocab <= MAX_ARGMAX_VOCAB
        length = len(prompt_ids)
        self._command({slot.index: self._row(PREFILL, length=length, capture=slot.capture_on,
                                             context=max_length or 0)})
        h0 = self.target.embed(torch.tensor([prompt_ids], device=self.device))   # [1, P, d]
        captured, logits = {}, None
        if self.hosted:
            slot.cache = self.stage0.new_cache(max_length)
            slot.rows0 = StageRows(length)
            stage0 = frozenset(self.capture_of[0]) if slot.capture_on else frozenset()
            out, own = self.stage0.run_stage(0, h0, torch.arange(length, device=self.device), slot.cache, stage0)
            captured.update(own)
            self.sends.append(comm.send(out, 1, TAG_PREFILL, self.wire))
        else:
            self.sends.append(comm.send(h0, 1, TAG_PREFILL, self.wire))
        slot.active = True
        try:
            for s in self.remote:
                size = self._payload_size(s, length, slot.capture_on, exiting=1)
                if size:
                    flat = comm.recv(size, torch.float32, rank_of(s, self.hosted), TAG_PAYLOAD, self.timeout,
                                     self._what(s, "prefilling"), self.payload_wire.device)
                    last_logits = self._unpack(s, flat, length, slot.capture_on, captured)
                    logits = last_logits if last_logits is not None else logits
        except comm.PipelineFailure as exc:
            self._fail(exc)
        if 0 in capture:
            captured[0] = h0
        return logits, {layer: h for layer, h in captured.items() if layer in capture}

    def queue(self, slot: Slot, step: Step, entering, flight: Flight, probe: bool = False) -> None:
        """The slot's next step, sent with every other queued slot's by `run`."""
        slot.step, slot.flight, slot.entering, slot.probe = step, flight, entering, probe
        slot.levels = {s: flight.level(pos) for s, pos in enumerate(step.work) if step.runs(s)}
        slot.out = StepOutput()
        self.queued.append(slot)

    def run(self) -> None:
        """Send the queued slots' step: one control message, stage 0's rows (run here when hosted), and receives
        posted for every stage's payload."""
        queued, self.queued = sorted(self.queued, key=lambda slot: slot.index), []
        if not queued:
            return
        self._command({slot.index: self._row(PROBE if slot.probe else STEP, crop=slot.crop, capture=slot.capture_on,
                                             work=slot.step.work, argmax=slot.argmax, flight=slot.flight)
                       for slot in queued})
        self.steps += 1
        self.most = max(self.most, len(queued))
        for slot in queued:
            slot.crop = -1
        # Rank 1's payload is expected only after this step's rows are sent to it: over NCCL the two ranks share one
        # stream, where a receive posted first would hold up the send it waits for. The other stages' go first, so
        # that their payloads arrive while stage 0 runs here.
        self._expect(queued, [s for s in self.remote if rank_of(s, self.hosted) != 1])
        entering = [slot for slot in queued if slot.entering is not None]
        if entering:
            hidden = torch.cat([slot.entering for slot in entering], 1)
            try:
                if self.hosted:   # the stage processes started on their control rows; stage 0 runs here meanwhile
                    hidden = self._run_stage0(entering, hidden)
                # rank 1 runs stage 0, or stage 1 when hosted
                self.sends.append(comm.send(hidden, 1, TAG_HIDDEN, self.wire))
            except comm.PipelineFailure as exc:
                self._fail(exc)
        self._expect(queued, [s for s in self.remote if rank_of(s, self.hosted) == 1])
        self.waiting.sort(key=lambda entry: entry[0])

    def _expect(self, queued: list[Slot], stages: list[int]) -> None:
        """Post the receives of `stages`' payloads for the step of `queued`."""
        for s in stages:
            slots = [slot for slot in queued if s in slot.levels]
            size = sum(self._payload_size(s, len(slot.levels[s]), slot.capture_on, slot.argmax) for slot in slots)
            if size:
                self.waiting.append((s, comm.Pending(size, torch.float32, rank_of(s, self.hosted), TAG_PAYLOAD,
                                                     self._what(s, "running a step"), self.payload_wire.device),
                                     slots))

    def _run_stage0(self, slots: list[Slot], hidden: torch.Tensor) -> torch.Tensor:
        """The hosted stage 0 on every slot's entering rows hidden [1, R, d]: each slot's captured rows into its
        output; returns what goes on to stage 1."""
        capture = frozenset(self.capture_of[0]) if any(slot.capture_on for slot in slots) else frozenset()
        bounds = [0]
        for slot in slots:
            bounds.append(bounds[-1] + len(slot.levels[0]))
        if slots[0].probe:
            out, captured = hidden, {layer: hidden for layer in capture}
        else:
            segments = []
            for slot in slots:
                slot.rows0.fold(slot.flight)
                visible = level_mask(slot.rows0, slot.levels[0], slot.flight, self.device)
                positions = [slot.flight.nodes[node].pos for node in slot.levels[0]]
                segments.append(Segment(slot.cache, positions, visible))
            out, captured, bounds = run_rows(self.stage0, hidden, segments, self.bounds[0], self.bounds[1], capture)
            for slot in slots:
                slot.rows0.append(slot.levels[0], [slot.flight.nodes[node].pos for node in slot.levels[0]])
        for slot, lo, hi in zip(slots, bounds, bounds[1:]):
            if slot.capture_on:
                self._split(slot, 0, {layer: h[:, lo:hi] for layer, h in captured.items()})
        return out

    def _split(self, slot: Slot, stage: int, rows: dict) -> None:
        """{layer: [1, k, d]} of a level's k nodes -> slot.out.features[node] = {layer: [1, 1, d]}."""
        for i, node in enumerate(slot.levels[stage]):
            slot.out.features.setdefault(node, {}).update({layer: h[:, i: i + 1] for layer, h in rows.items()})

    def gather(self) -> None:
        """Receive the step in flight: every stage's payload, split into each slot's output."""
        try:
            for s, pending, slots in self.waiting:
                flat, offset = pending.get(self.timeout), 0
                for slot in slots:
                    size = self._payload_size(s, len(slot.levels[s]), slot.capture_on, slot.argmax)
                    rows = {}
                    exit_row = self._unpack(s, flat[offset: offset + size], len(slot.levels[s]), slot.capture_on,
                                            rows)
                    offset += size
                    self._split(slot, s, rows)
                    if exit_row is None:
                        continue
                    exiting = slot.out.exit_nodes = list(slot.levels[s])
                    if slot.argmax:
                        tokens = [int(t) for t in exit_row.tolist()]
                        slot.out.exit_argmax = tokens[0] if len(exiting) == 1 else tokens
                    else:
                        slot.out.exit_logits = exit_row if len(exiting) == 1 else exit_row.view(len(exiting), -1)
        except comm.PipelineFailure as exc:
            self._fail(exc)
        finally:
            self.waiting = []

    def rollback_slot(self, slot: Slot, length: int) -> None:
        slot.crop = length  # travels with the slot's next row, before any stage runs it again
        if self.hosted:
            slot.cache.crop(length)
            slot.rows0.crop(length)

    def prune_slot(self, slot: Slot, flight: Flight) -> None:
        # the stage processes prune from the flight the slot's next row carries
        if self.hosted:
            moved = slot.rows0.prune(flight)
            if moved is not None:
                slot.cache.keep(*moved, layers=stage_layers(self.bounds, 0))

    def _end(self, slot: Slot) -> None:
        # A crop still pending belongs to the generation that just ended: sent with the next generation's first
        # step it would cut that generation's fresh caches back to the old length (tests/test_reuse.py).
        slot.crop = -1
        if slot.active:
            self._command({slot.index: self._row(END)})   # at once: stages with no sequence left wait idle
            slot.active = False
            slot.cache = slot.rows0 = None

    # ---------------------------------------------------------------- several sequences
    def sequence(self) -> SlotStages:
        """An executor for one more sequence decoding beside others (its slot is free again at its `finish`)."""
        free = [i for i in range(self.capacity) if i not in self.held]
        if not free or self.solo.active:
            raise RuntimeError(f"all {self.capacity} slots of the pipeline are taken (Setup.slots)")
        self.held.add(free[0])
        return SlotStages(self, Slot(free[0]))

    def release(self, slot: Slot) -> None:
        """The slot's sequence ended (or was cancelled): its queued step is dropped, the stages drop its caches, and
        the slot is free."""
        self.queued = [queued for queued in self.queued if queued is not slot]
        self._end(slot)
        self.held.discard(slot.index)

    # ---------------------------------------------------------------- StageExecutor: one sequence, alone
    def embed(self, token: int) -> torch.Tensor:
        return self.target.embed(torch.tensor([[token]], device=self.device))

    def prefill(self, prompt_ids, capture, max_length=None, argmax_exit=False):
        if self.held:
            raise RuntimeError("the pipeline's slots are decoding several sequences (spd.runtime.seed)")
        self.finish()   # also drops a crop left by a generation that ended on a rejection: it was for old caches
        return self.prefill_slot(self.solo, prompt_ids, capture, max_length, argmax_exit)

    def launch(self, step: Step, entering, flight=None, probe: bool = False):
        self.queue(self.solo, step, entering, flight or chain_flight(step), probe)
        self.run()

    def collect(self) -> StepOutput:
        self.gather()
        return self.solo.out

    def time_messages(self, steps: int = 200, warmup: int = 20) -> list[float]:
        """Seconds per steady-state step spent on messages alone (every stage busy, no compute), one per step."""
        self.finish()
        self.solo.capture_on = bool(self.setup.capture)
        self.solo.argmax = False
        entering = torch.zeros(1, 1, self.d, device=self.device, dtype=self.dtype)
        times = []
        step = first_step(0, self.n)  # fills like a decode, then every step is a full one
        for _ in range(warmup + steps):
            start = time.perf_counter()
            self.launch(step, entering, probe=True)
            self.collect()
            times.append(time.perf_counter() - start)
            step = next_step(step, None if step.exiting is None else True)
        self.solo.active = True
        self.finish()
        return times[warmup:]

    def rollback(self, length):
        self.rollback_slot(self.solo, length)

    def prune(self, flight: Flight):
        self.prune_slot(self.solo, flight)

    def finish(self) -> None:
        self._end(self.solo)

    def abort(self) -> None:
        """After a failure: tell every stage still listening to stop (each says so in one line, exits non-zero)."""
        if self.closed:
            return
        self.closed = True
        works = []
        msg = message({slot: self._row(ABORT) for slot in range(self.capacity)}, self.n, self.setup.width,
                      self.capacity)
        for s in self.remote:
            try:
                works.append(comm.send(msg, rank_of(s, self.hosted), TAG_CONTROL))
            except RuntimeError:
                pass
        for work in works:
            try:
                comm.wait(work, 2.0, "aborting")
            except comm.PipelineFailure:
                pass  # that stage is gone already

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.finish()
            self._command({0: self._row(STOP)})
            self._flush_sends()
        finally:
            if self.processes is not None:
                self.processes.join()
