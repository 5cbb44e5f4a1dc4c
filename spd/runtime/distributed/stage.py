"""A stage process: load this stage's layers, then follow the controller's commands until told to stop.

Each step it takes the state entering its stage (from the controller for stage 1, else the one the previous
stage sent last step), runs its layers with its own KV cache, passes the output on, and sends the controller the
feature rows the drafter reads (the last stage: plus the exiting token's logits, or only their argmax when the
controller decodes greedily, since it holds the head). With several slots (SEED's schedule) it keeps a cache per
sequence and runs every slot's rows of a step in one forward (spd.targets.ragged.run_rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spd.runtime.distributed import comm
from spd.runtime.distributed.placement import on_wire, stage_device
from spd.runtime.distributed.protocol import (ABORT, END, PREFILL, PROBE, STEP, STOP, TAG_CONTROL, TAG_HIDDEN,
                                              TAG_PAYLOAD, TAG_PREFILL, TAG_READY, Control, Setup, control_size,
                                              first_remote, parse_message, stage_capture, stage_layers)
from spd.runtime.executor import level_mask
from spd.verify.tree_rows import StageRows
from spd.runtime.schedule import IDLE
from spd.targets.ragged import Segment, exit_logits, run_rows
from spd.targets.loaded import DTYPES
from spd.targets.weight_cache import load_parts
from spd.targets.stages import StagedTarget


def receive_setup() -> Setup:
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class StageServer:
    def __init__(self, setup: Setup, rank: int):
        self.setup = setup
        self.rank = rank
        self.stage = rank - 1 + first_remote(setup.hosted)   # rank 0 is the controller, which may run stage 0
        self.n = setup.n
        self.last = self.stage == self.n - 1
        torch.set_num_threads(setup.threads)
        device = self.device = stage_device(setup.device, self.stage)
        if device.type == "cuda":
            torch.cuda.set_device(device)   # NCCL and anything allocated on "cuda" then use this process's GPU
        parts = load_parts(setup.cache_dir, stage_layers(setup.bounds, self.stage), embed=False, head=self.last,
                           dtype=DTYPES[setup.dtype], device=device, weights=setup.weights)
        self.target = StagedTarget(parts.model, self.n, setup.bounds)
        self.dtype = self.target.dtype  # once: the property searches the parameters for a materialised one
        self.wire = on_wire(device, self.dtype, setup.nccl)
        # the argmax of a greedy exit travels in the payload, exact only in float32
        self.payload_wire = on_wire(device, torch.float32, setup.nccl)
        self.capture = stage_capture(setup.capture, setup.bounds, self.stage)
        self.d = parts.model.config.hidden_size
        self.sends = []
        self.pending: comm.Pending | None = None   # what the previous stage sends during the current step
        self.caches: dict[int, object] = {}        # slot -> this stage's KV cache of that sequence
        self.rows: dict[int, StageRows] = {}       # slot -> its rows in that cache
        self.inbox: dict[int, tuple[torch.Tensor, list[int]]] = {}   # slot -> (rows [1, k, d], their nodes) from
                                                                     # the previous stage, for the slot's next step

    def what(self, action: str) -> str:
        return f"stage {self.stage + 1}/{self.n} (rank {self.rank}) {action}"

    def _send_on(self, out: torch.Tensor, prefill: bool = False) -> None:
        if not self.last:
            # the tag says what the message is, not its length: a one-token prompt is still a prefill
            self.sends.append(comm.send(out, self.rank + 1, TAG_PREFILL if prefill else TAG_HIDDEN, self.wire))

    def _payload(self, captured: dict, lo: int, hi: int, capture: bool, exit_logits, argmax: bool) -> list:
        """One slot's part of the payload: its captured rows lo..hi-1 (each [k * d]), then its exit."""
        parts = [captured[layer][0, lo:hi].reshape(-1) for layer in (self.capture if capture else [])]
        if self.last:
            # greedy verification needs only the argmax: 4 bytes on the critical path instead of a [V] row
            parts.append(exit_logits.argmax(-1).float().reshape(-1) if argmax else exit_logits.reshape(-1))
        return parts

    def _send_payload(self, parts: list) -> None:
        if parts:
            self.sends.append(comm.send(torch.cat(parts), 0, TAG_PAYLOAD, self.payload_wire))

    def _prefill(self, slot: int, c: Control) -> None:
        s = self.setup
        self.caches[slot] = self.target.new_cache(c.context or None)   # static: this stage's layers only
        self.rows[slot] = StageRows(c.length)
        self.inbox.pop(slot, None)
        hidden = comm.recv((1, c.length, self.d), self.wire.dtype, self.rank - 1, TAG_PREFILL, s.step_timeout_s,
                           self.what("waiting for the prompt's states"), self.wire.device)
        hidden = hidden.to(self.device, self.dtype)
        capture = frozenset(self.capture if c.capture else [])
        out, captured = self.target.run_stage(self.stage, hidden, torch.arange(c.length, device=self.device),
                                              self.caches[slot], capture)
        self._send_on(out, prefill=True)
        logits = self.target.logits(out[0, -1]) if self.last else None
        self._send_payload(self._payload(captured, 0, c.length, c.capture, logits, False))

    def _forget(self, slot: int, c: Control) -> None:
        """A rejection crops to `crop`; otherwise drop the rows of tree nodes the flight no longer holds."""
        cache, rows = self.caches[slot], self.rows[slot]
        if c.crop < 0 or c.flight.left is not None:
            # FlowSpec's walk may verify several nodes and then flush: what it dropped on the way goes first
            moved = rows.prune(c.flight)
            if moved is not None:
                cache.keep(*moved, layers=stage_layers(self.setup.bounds, self.stage))
        if c.crop >= 0:
            cache.crop(c.crop)
            rows.crop(c.crop)

    def _step(self, steps: list[tuple[int, Control]]) -> None:
        """One step of every slot in `steps`: the rows of those at this stage in one forward, in slot order."""
        s = self.setup
        probe = steps[0][1].cmd == PROBE
        if not probe:
            for slot, c in steps:
                self._forget(slot, c)
        if self.stage > 0:
            before = [(slot, c.flight.level(c.work[self.stage - 1])) for slot, c in steps
                      if c.work[self.stage - 1] != IDLE]
            if before:
                self.pending = comm.Pending((1, sum(len(nodes) for _, nodes in before), self.d), self.wire.dtype,
                                            self.rank - 1, TAG_HIDDEN, self.what("waiting for the previous stage"),
                                            self.wire.device, slots=before)
        mine = [(slot, c, c.flight.level(c.work[self.stage])) for slot, c in steps if c.work[self.stage] != IDLE]
        held = {slot: self.inbox.pop(slot, None) for slot, _ in steps}   # rows not taken now are stale
        if not mine:
            return
        if self.stage == 0:
            hidden = comm.recv((1, sum(len(nodes) for *_, nodes in mine), self.d), self.wire.dtype, 0, TAG_HIDDEN,
                               s.step_timeout_s, self.what("waiting for the entering token"), self.wire.device)
        else:
            hidden = torch.cat([self._taken(held[slot], nodes, c.work[self.stage]) for slot, c, nodes in mine], 1)
        hidden = hidden.to(self.device, self.dtype)
        capture = frozenset(self.capture if any(c.capture for _, c, _ in mine) else [])
        if probe:   # the messages of a step without its compute: what communication alone costs per step
            out, captured = hidden, {layer: hidden for layer in capture}
            bounds = [0]
            for _, _, nodes in mine:
                bounds.append(bounds[-1] + len(nodes))
        else:
            segments = [Segment(self.caches[slot], [c.flight.nodes[node].pos for node in nodes],
                                level_mask(self.rows[slot], nodes, c.flight, self.device)) for slot, c, nodes in mine]
            b = s.bounds
            out, captured, bounds = run_rows(self.target, hidden, segments, b[self.stage], b[self.stage + 1],
                                             capture)
        self._send_on(out)
        exits = [None] * len(mine)
        if self.last:
            exits = [out.new_zeros(self.target.config.vocab_size)] * len(mine) if probe else \
                exit_logits(self.target, out, bounds)
        parts = []
        for (slot, c, nodes), lo, hi, logits in zip(mine, bounds, bounds[1:], exits):
            parts += self._payload(captured, lo, hi, c.capture, logits, c.argmax)
            if not probe:
                self.rows[slot].append(nodes, [c.flight.nodes[node].pos for node in nodes])
        self._send_payload(parts)

    def _taken(self, held, nodes: list[int], pos: int) -> torch.Tensor:
        """The rows of `nodes` among what the previous stage sent (a prune may have dropped some), in their order."""
        if held is None or not set(nodes) <= set(held[1]):
            raise comm.PipelineFailure(self.what(f"expected nodes {nodes} at position {pos}, holds "
                                                 f"{None if held is None else held[1]}"))
        rows, sent = held
        return rows if nodes == sent else rows[:, [sent.index(node) for node in nodes]]

    def _drain(self) -> None:
        """What the previous stage sent during the last step, into each slot's inbox: always received, so the
        channel from the previous stage stays in step."""
        if self.pending is None:
            return
        rows, start = self.pending.get(self.setup.step_timeout_s), 0
        for slot, nodes in self.pending.info["slots"]:
            self.inbox[slot] = (rows[:, start: start + len(nodes)], nodes)
            start += len(nodes)
        self.pending = None

    def serve(self) -> None:
        s = self.setup
        active = False
        self.sends.append(comm.send(torch.zeros(1), 0, TAG_READY))
        while True:
            values = comm.recv(control_size(self.n, s.width) * s.slots, torch.long, 0, TAG_CONTROL,
                               s.step_timeout_s if active else s.idle_timeout_s, self.what("waiting for the controller"))
            controls = parse_message(values, self.n, s.width, s.slots)
            cmds = {c.cmd for c in controls}
            if ABORT in cmds:
                raise comm.PipelineFailure(self.what("was stopped by the controller after a failure elsewhere"))
            for work_item in self.sends:
                comm.wait(work_item, s.step_timeout_s, self.what("sending"))
            self.sends = []
            self._drain()
            if STOP in cmds:
                return
            for slot, c in enumerate(controls):
                if c.cmd == END:   # the sequence ended: its memory goes
                    self.caches.pop(slot, None)
                    self.rows.pop(slot, None)
                    self.inbox.pop(slot, None)
                elif c.cmd == PREFILL:
                    self._prefill(slot, c)
            steps = [(slot, c) for slot, c in enumerate(controls) if c.cmd in (STEP, PROBE)]
            if steps:
                self._step(steps)
            active = bool(self.caches) or PROBE in cmds
