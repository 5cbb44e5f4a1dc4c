"""The controller's side of the multi-process pipeline (rank 0): a `StageExecutor` whose stages are processes.

Placement, by measured cost on SmolLM2 (docs/results.md): the 49,152-row LM head costs about as much as 8 decoder
layers on a CPU core, more than the module's draft. It sits on the last stage, where `stage_bounds=balanced` can
give that stage fewer layers to pay for it; on the controller it would run *after* the step, serially, every step.
Verification stays on the controller: it needs the draft's q and the sampling generator, costs ~30 µs, and keeps
every random draw in the same order as `runtime=local`, so seeded sampling gives the same tokens. When greedy, the
last stage sends only the argmax (verification needs nothing else) instead of a [V] row per step.

A hosted controller (`Setup.hosted`) also runs stage 0, so n stages take n processes: on a CPU with as many cores
as stages, a separate controller would be one busy process too many. Stage 0 then runs at `launch`, before the
drafter; `stage_bounds=balanced` gives it fewer layers for the controller's share of the step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from spd.runtime.distributed import comm
from spd.runtime.distributed.protocol import (ABORT, END, MAX_ARGMAX_VOCAB, PREFILL, PROBE, STEP, STOP, TAG_CONTROL,
                                              TAG_HIDDEN, TAG_PAYLOAD, TAG_PREFILL, TAG_READY, Setup, control,
                                              first_remote, rank_of, stage_capture, stage_layers, world_size)
from spd.runtime.executor import StageExecutor, StepOutput, level_mask
from spd.runtime.flight import Flight, StageRows
from spd.runtime.schedule import Step, first_step, next_step
from spd.targets.stages import StagedTarget
from spd.targets.weight_cache import load_parts


def chain_flight(step: Step) -> Flight:
    """A chain's flight for a step (one node per position, ids = positions): what a call without one runs."""
    return Flight.restore(1, [(pos, pos, pos - 1) for pos, _ in step.in_flight()])


class DistributedStages(StageExecutor):
    """target: the controller's parts of the target (embedding; the layers are in the stage processes, stage 0's in
    this one when it hosts it)."""

    trees = True

    def __init__(self, target: StagedTarget, setup: Setup, processes=None, load_timeout_s: float = 600.0):
        self.target = target
        self.setup = setup
        self.processes = processes          # the local stage processes when this controller spawned them
        self.n = setup.n
        self.bounds = setup.bounds
        self.device = target.device
        self.dtype = target.dtype  # once: StagedTarget.dtype searches the parameters for a materialised one
        self.d = target.config.hidden_size
        self.vocab = target.config.vocab_size
        self.timeout = setup.step_timeout_s
        self.capture_of = [stage_capture(setup.capture, setup.bounds, s) for s in range(self.n)]
        self.hosted = setup.hosted
        self.remote = range(first_remote(setup.hosted), self.n)   # the stages that run in stage processes
        self.world = world_size(self.n, self.hosted)               # processes in all, this one included
        self.sends = []
        self.active = False
        self.argmax = False
        self.crop = -1
        self.closed = False
        dist.broadcast_object_list([setup], src=0)
        if self.hosted:  # while the stage processes load theirs
            parts = load_parts(setup.cache_dir, stage_layers(setup.bounds, 0), embed=False, head=False,
                               dtype=self.dtype, device=self.device)
            self.stage0 = StagedTarget(parts.model, self.n, setup.bounds)
        for s in self.remote:
            comm.recv(1, torch.float32, rank_of(s, self.hosted), TAG_READY, load_timeout_s,
                      self._what(s, "loading its layers"))

    def _control(self, cmd: int, **fields) -> torch.Tensor:
        return control(cmd, self.n, self.setup.width, **fields)

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

    def _command(self, row: torch.Tensor) -> None:
        self._flush_sends()
        try:
            for s in self.remote:
                self.sends.append(comm.send(row, rank_of(s, self.hosted), TAG_CONTROL))
        except comm.PipelineFailure as exc:
            self._fail(exc)

    def _payload_size(self, stage: int, length: int, capture: bool, argmax: bool = False) -> int:
        rows = len(self.capture_of[stage]) * length * self.d if capture else 0
        return rows + ((1 if argmax else self.vocab) if stage == self.n - 1 else 0)

    def _unpack(self, stage: int, flat: torch.Tensor, length: int, capture: bool, sink: dict) -> torch.Tensor | None:
        """Feature rows into sink {layer: [1, length, d]}; returns what the last stage sent of the exiting token
        (logits [V], or its argmax [1])."""
        offset = 0
        for layer in (self.capture_of[stage] if capture else []):
            size = length * self.d
            sink[layer] = flat[offset: offset + size].view(1, length, self.d).to(self.device, self.dtype)
            offset += size
        return flat[offset:].to(self.device) if stage == self.n - 1 else None

    def _run_stage0(self, hidden: torch.Tensor, positions: torch.Tensor, sink: dict, probe: bool = False,
                    prefill: bool = False, visible=None) -> None:
        """The hosted stage 0 on hidden [1, T, d]: captured rows into sink, the output on to stage 1's process."""
        capture = frozenset(self.capture_of[0]) if self.capture_on else frozenset()
        if probe:
            out, captured = hidden, {layer: hidden for layer in capture}
        elif visible is not None:
            out, captured = self.stage0.run_layers(hidden, positions.to(self.device), self.bounds[0], self.bounds[1],
                                                   self.cache, capture, visible=visible)
        else:
            out, captured = self.stage0.run_stage(0, hidden, positions.to(self.device), self.cache, capture)
        sink.update(captured)
        self.sends.append(comm.send(out.float(), rank_of(1, hosted=True), TAG_PREFILL if prefill else TAG_HIDDEN))

    # ---------------------------------------------------------------- StageExecutor
    def embed(self, token: int) -> torch.Tensor:
        return self.target.embed(torch.tensor([[token]], device=self.device))

    def prefill(self, prompt_ids, capture, max_length=None, argmax_exit=False):
        self.finish()   # also drops a crop left by a generation that ended on a rejection: it was for old caches
        self.capture_on = bool(capture)
        if self.capture_on and not set(capture) - {0} <= set(self.setup.capture):
            raise ValueError(f"capture {sorted(capture)} was not announced at setup ({self.setup.capture})")
        self.argmax = argmax_exit and self.vocab <= MAX_ARGMAX_VOCAB
        length = len(prompt_ids)
        self._command(self._control(PREFILL, length=length, capture=self.capture_on, context=max_length or 0))
        h0 = self.target.embed(torch.tensor([prompt_ids], device=self.device))   # [1, P, d]
        captured, logits = {}, None
        if self.hosted:
            self.cache = self.stage0.new_cache(max_length)
            self.rows0 = StageRows(length)
            self._run_stage0(h0, torch.arange(length), captured, prefill=True)
        else:
            self.sends.append(comm.send(h0.float(), 1, TAG_PREFILL))
        self.active = True
        try:
            for s in self.remote:
                size = self._payload_size(s, length, self.capture_on)
                if size:
                    flat = comm.recv(size, torch.float32, rank_of(s, self.hosted), TAG_PAYLOAD, self.timeout,
                                     self._what(s, "prefilling"))
                    last_logits = self._unpack(s, flat, length, self.capture_on, captured)
                    logits = last_logits if last_logits is not None else logits
        except comm.PipelineFailure as exc:
            self._fail(exc)
        if 0 in capture:
            captured[0] = h0
        return logits, {layer: h for layer, h in captured.items() if layer in capture}

    def launch(self, step: Step, entering, flight=None, probe: bool = False):
        flight = flight or chain_flight(step)
        self._command(self._control(PROBE if probe else STEP, crop=self.crop, capture=self.capture_on,
                                    work=step.work, argmax=self.argmax, flight=flight))
        self.crop = -1
        self.step = step
        self.levels = {s: flight.level(pos) for s, pos in enumerate(step.work) if step.runs(s)}
        self.waiting = [(s, comm.Pending(self._payload_size(s, len(self.levels[s]), self.capture_on, self.argmax),
                                         torch.float32, rank_of(s, self.hosted), TAG_PAYLOAD,
                                         self._what(s, "running a step")))
                        for s in self.remote if step.runs(s) and self._payload_size(s, 1, self.capture_on)]
        self.local = {}
        if entering is None:
            return
        if self.hosted:   # the stage processes started on their control rows; stage 0 runs here meanwhile
            nodes = self.levels[0]
            visible = None
            if not probe:
                self.rows0.fold(flight)
                visible = level_mask(self.rows0, nodes, flight, self.device)
            self._run_stage0(entering, torch.full((len(nodes),), step.work[0]), self.local, probe, visible=visible)
            if not probe:
                self.rows0.append(nodes, step.work[0])
        else:
            try:
                self.sends.append(comm.send(entering.float(), 1, TAG_HIDDEN))
            except comm.PipelineFailure as exc:
                self._fail(exc)

    def _split(self, stage: int, rows: dict, out: StepOutput) -> None:
        """{layer: [1, k, d]} of a level's k nodes -> out.features[node] = {layer: [1, 1, d]}."""
        for i, node in enumerate(self.levels[stage]):
            out.features[node] = {layer: h[:, i: i + 1] for layer, h in rows.items()}

    def collect(self) -> StepOutput:
        out = StepOutput()
        if self.local or (self.hosted and self.step.runs(0)):
            self._split(0, self.local, out)
        try:
            for s, pending in self.waiting:
                flat = pending.get(self.timeout)
                rows = {}
                exit_row = self._unpack(s, flat, len(self.levels[s]), self.capture_on, rows)
                self._split(s, rows, out)
                if exit_row is None:
                    continue
                if self.argmax:
                    out.exit_argmax = int(exit_row.item())
                else:
                    out.exit_logits = exit_row
        except comm.PipelineFailure as exc:
            self._fail(exc)
        self.waiting = []
        return out

    def time_messages(self, steps: int = 200, warmup: int = 20) -> list[float]:
        """Seconds per steady-state step spent on messages alone (every stage busy, no compute), one per step."""
        self.finish()
        self.capture_on = bool(self.setup.capture)
        self.argmax = False
        entering = torch.zeros(1, 1, self.d)
        times = []
        step = first_step(0, self.n)  # fills like a decode, then every step is a full one
        for _ in range(warmup + steps):
            start = time.perf_counter()
            self.launch(step, entering, probe=True)
            self.collect()
            times.append(time.perf_counter() - start)
            step = next_step(step, None if step.exiting is None else True)
        self.active = True
        self.finish()
        return times[warmup:]

    def rollback(self, length):
        self.crop = length  # travels with the next command, before any stage runs again
        if self.hosted:
            self.cache.crop(length)
            self.rows0.crop(length)

    def prune(self, flight: Flight):
        # the stage processes prune from the flight their next control row carries
        if self.hosted:
            moved = self.rows0.prune(flight)
            if moved is not None:
                self.cache.keep(*moved, layers=stage_layers(self.bounds, 0))

    def finish(self) -> None:
        # A crop still pending belongs to the generation that just ended: sent with the next generation's first
        # step it would cut that generation's fresh caches back to the old length (issue 21).
        self.crop = -1
        if self.active:
            self._command(self._control(END))
            self.active = False

    def abort(self) -> None:
        """After a failure: tell every stage still listening to stop (each says so in one line, exits non-zero)."""
        if self.closed:
            return
        self.closed = True
        works = []
        for s in self.remote:
            try:
                works.append(comm.send(self._control(ABORT), rank_of(s, self.hosted), TAG_CONTROL))
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
            self._command(self._control(STOP))
            self._flush_sends()
        finally:
            if self.processes is not None:
                self.processes.join()
