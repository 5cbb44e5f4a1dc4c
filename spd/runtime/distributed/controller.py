"""The controller's side of the multi-process pipeline (rank 0): a `StageExecutor` whose stages are processes.

Placement, by measured cost on SmolLM2 (docs/results.md): the 49,152-row LM head costs about as much as 8 decoder
layers on a CPU core, more than the module's draft. It sits on the last stage, where `stage_bounds=balanced` can
give that stage fewer layers to pay for it; on the controller it would run *after* the step, serially, every step.
Verification stays on the controller: it needs the draft's q and the sampling generator, costs ~30 µs, and keeps
every random draw in the same order as `runtime=local`, so seeded sampling gives the same tokens.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from spd.runtime.distributed import comm
from spd.runtime.distributed.protocol import (ABORT, END, PREFILL, PROBE, STEP, STOP, TAG_CONTROL, TAG_HIDDEN, TAG_PAYLOAD,
                                              TAG_PREFILL, TAG_READY, Setup, control, stage_capture)
from spd.runtime.executor import StageExecutor, StepOutput
from spd.runtime.schedule import Step, first_step, next_step
from spd.target.stages import StagedTarget


class DistributedStages(StageExecutor):
    """target: the controller's parts of the target (embedding; the layers are in the stage processes)."""

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
        self.sends = []
        self.active = False
        self.crop = -1
        self.closed = False
        dist.broadcast_object_list([setup], src=0)
        for s in range(self.n):
            comm.recv(1, torch.float32, s + 1, TAG_READY, load_timeout_s, self._what(s, "loading its layers"))

    def _what(self, stage: int, action: str) -> str:
        return f"stage {stage + 1}/{self.n} (rank {stage + 1}) {action}"

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
        for s in range(self.n):
            self.sends.append(comm.send(row, s + 1, TAG_CONTROL))

    def _payload_size(self, stage: int, length: int, capture: bool) -> int:
        rows = len(self.capture_of[stage]) * length * self.d if capture else 0
        return rows + (self.vocab if stage == self.n - 1 else 0)

    def _unpack(self, stage: int, flat: torch.Tensor, length: int, capture: bool, sink: dict) -> torch.Tensor | None:
        """Feature rows into sink {layer: [1, length, d]}; returns the logits [V] when the last stage sent them."""
        offset = 0
        for layer in (self.capture_of[stage] if capture else []):
            size = length * self.d
            sink[layer] = flat[offset: offset + size].view(1, length, self.d).to(self.device, self.dtype)
            offset += size
        return flat[offset:].to(self.device) if stage == self.n - 1 else None

    # ---------------------------------------------------------------- StageExecutor
    def embed(self, token: int) -> torch.Tensor:
        return self.target.embed(torch.tensor([[token]], device=self.device))

    def prefill(self, prompt_ids, capture, max_length=None):
        self.finish()   # also drops a crop left by a generation that ended on a rejection: it was for old caches
        self.capture_on = bool(capture)
        if self.capture_on and not set(capture) - {0} <= set(self.setup.capture):
            raise ValueError(f"capture {sorted(capture)} was not announced at setup ({self.setup.capture})")
        length = len(prompt_ids)
        self._command(control(PREFILL, self.n, length=length, capture=self.capture_on, context=max_length or 0))
        h0 = self.target.embed(torch.tensor([prompt_ids], device=self.device))   # [1, P, d]
        self.sends.append(comm.send(h0.float(), 1, TAG_PREFILL))
        self.active = True
        captured, logits = {}, None
        try:
            for s in range(self.n):
                size = self._payload_size(s, length, self.capture_on)
                if size:
                    flat = comm.recv(size, torch.float32, s + 1, TAG_PAYLOAD, self.timeout,
                                     self._what(s, "prefilling"))
                    last_logits = self._unpack(s, flat, length, self.capture_on, captured)
                    logits = last_logits if last_logits is not None else logits
        except comm.PipelineFailure as exc:
            self._fail(exc)
        if 0 in capture:
            captured[0] = h0
        return logits, {layer: h for layer, h in captured.items() if layer in capture}

    def launch(self, step: Step, entering, probe: bool = False):
        self._command(control(PROBE if probe else STEP, self.n, crop=self.crop, capture=self.capture_on,
                              work=step.work))
        self.crop = -1
        if entering is not None:
            self.sends.append(comm.send(entering.float(), 1, TAG_HIDDEN))
        self.step = step
        self.waiting = [(s, comm.Pending(self._payload_size(s, 1, self.capture_on), torch.float32, s + 1,
                                         TAG_PAYLOAD, self._what(s, "running a step")))
                        for s in range(self.n) if step.runs(s) and self._payload_size(s, 1, self.capture_on)]

    def collect(self) -> StepOutput:
        out = StepOutput()
        try:
            for s, pending in self.waiting:
                flat = pending.get(self.timeout)
                pos = self.step.work[s]
                out.features[pos] = {}
                logits = self._unpack(s, flat, 1, self.capture_on, out.features[pos])
                if logits is not None:
                    out.exit_logits = logits
        except comm.PipelineFailure as exc:
            self._fail(exc)
        self.waiting = []
        return out

    def time_messages(self, steps: int = 200, warmup: int = 20) -> list[float]:
        """Seconds per steady-state step spent on messages alone (every stage busy, no compute), one per step."""
        self.finish()
        self.capture_on = bool(self.setup.capture)
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

    def finish(self) -> None:
        # A crop still pending belongs to the generation that just ended: sent with the next generation's first
        # step it would cut that generation's fresh caches back to the old length (issue 21).
        self.crop = -1
        if self.active:
            self._command(control(END, self.n))
            self.active = False

    def abort(self) -> None:
        """After a failure: tell every stage still listening to stop (each says so in one line, exits non-zero)."""
        if self.closed:
            return
        self.closed = True
        works = []
        for s in range(self.n):
            try:
                works.append(comm.send(control(ABORT, self.n), s + 1, TAG_CONTROL))
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
            self._command(control(STOP, self.n))
            self._flush_sends()
        finally:
            if self.processes is not None:
                self.processes.join()
