"""A stage process: load this stage's layers, then follow the controller's commands until told to stop.

Each step it takes the state entering its stage (from the controller for stage 1, else the one the previous
stage sent last step), runs its layers with its own KV cache, passes the output on, and sends the controller the
feature rows the drafter reads (the last stage: plus the exiting token's logits, or only their argmax when the
controller decodes greedily, since it holds the head).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spd.runtime.distributed import comm
from spd.runtime.distributed.protocol import (ABORT, END, PREFILL, PROBE, STEP, STOP, TAG_CONTROL, TAG_HIDDEN,
                                              TAG_PAYLOAD, TAG_PREFILL, TAG_READY, Setup, control_size, first_remote,
                                              parse, stage_capture, stage_layers)
from spd.runtime.executor import level_mask
from spd.runtime.flight import Flight, StageRows
from spd.runtime.schedule import IDLE
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
        device = torch.device(setup.device)
        if device.type == "cuda" and torch.cuda.device_count() > 1:
            device = torch.device("cuda", self.stage % torch.cuda.device_count())  # one GPU per stage
        self.device = device
        parts = load_parts(setup.cache_dir, stage_layers(setup.bounds, self.stage), embed=False, head=self.last,
                           dtype=DTYPES[setup.dtype], device=device)
        self.target = StagedTarget(parts.model, self.n, setup.bounds)
        self.dtype = self.target.dtype  # once: the property searches the parameters for a materialised one
        self.capture = stage_capture(setup.capture, setup.bounds, self.stage)
        self.d = parts.model.config.hidden_size
        self.sends = []
        self.pending: comm.Pending | None = None   # what the previous stage sends during the current step

    def what(self, action: str) -> str:
        return f"stage {self.stage + 1}/{self.n} (rank {self.rank}) {action}"

    def _run(self, hidden, positions, capture: list[int], probe: bool = False, argmax: bool = False,
             prefill: bool = False, visible=None):
        hidden = hidden.to(self.device, self.dtype)
        if probe:  # the messages of a step without its compute: what communication alone costs per step
            out, captured = hidden, {layer: hidden for layer in capture}
        elif visible is not None:   # a tree level: each row sees the verified rows and its own ancestors
            b = self.setup.bounds
            out, captured = self.target.run_layers(hidden, positions.to(self.device), b[self.stage],
                                                   b[self.stage + 1], self.cache, frozenset(capture),
                                                   visible=visible)
        else:
            out, captured = self.target.run_stage(self.stage, hidden, positions.to(self.device), self.cache,
                                                  frozenset(capture))
        if not self.last:
            # the tag says what the message is, not its length: a one-token prompt is still a prefill
            self.sends.append(comm.send(out.float(), self.rank + 1, TAG_PREFILL if prefill else TAG_HIDDEN))
        parts = [captured[layer][0].reshape(-1) for layer in capture]    # each [T * d]
        if self.last:
            logits = out.new_zeros(self.target.config.vocab_size) if probe else self.target.logits(out[0, -1])
            # greedy verification needs only the argmax: 4 bytes on the critical path instead of a [V] row
            parts.append(logits.argmax().float().view(1) if argmax else logits.reshape(-1))
        if parts:
            self.sends.append(comm.send(torch.cat(parts).float(), 0, TAG_PAYLOAD))

    def _forget(self, crop: int, flight: Flight) -> None:
        """A rejection crops to `crop`; otherwise drop the rows of tree nodes the flight no longer holds."""
        if crop >= 0:
            self.cache.crop(crop)
            self.rows.crop(crop)
            return
        moved = self.rows.prune(flight)
        if moved is not None:
            self.cache.keep(*moved, layers=stage_layers(self.setup.bounds, self.stage))

    def serve(self) -> None:
        s = self.setup
        active = False
        self.sends.append(comm.send(torch.zeros(1), 0, TAG_READY))
        while True:
            row = comm.recv(control_size(self.n, s.width), torch.long, 0, TAG_CONTROL,
                            s.step_timeout_s if active else s.idle_timeout_s, self.what("waiting for the controller"))
            c = parse(row, self.n, s.width)
            cmd, work, flight = c.cmd, c.work, c.flight
            if cmd == ABORT:
                raise comm.PipelineFailure(self.what("was stopped by the controller after a failure elsewhere"))
            for work_item in self.sends:
                comm.wait(work_item, s.step_timeout_s, self.what("sending"))
            self.sends = []
            inbox, inbox_nodes = None, None
            if self.pending is not None:  # always drained, so the channel from the previous stage stays in step
                inbox, inbox_nodes = self.pending.get(s.step_timeout_s), self.pending.info["nodes"]
                self.pending = None
            capture = self.capture if c.capture else []
            if cmd == STOP:
                return
            if cmd == END:
                active = False
                continue
            if cmd == PREFILL:
                active = True
                self.cache = self.target.new_cache(c.context or None)   # static: this stage's layers only
                self.rows = StageRows(c.length)
                hidden = comm.recv((1, c.length, self.d), torch.float32, self.rank - 1, TAG_PREFILL,
                                   s.step_timeout_s, self.what("waiting for the prompt's states"))
                self._run(hidden, torch.arange(c.length), capture, prefill=True)
                continue
            assert cmd in (STEP, PROBE), cmd
            active = True
            probe = cmd == PROBE
            if not probe:
                self._forget(c.crop, flight)
            if self.stage > 0 and work[self.stage - 1] != IDLE:
                before = flight.level(work[self.stage - 1])
                self.pending = comm.Pending((1, len(before), self.d), torch.float32, self.rank - 1, TAG_HIDDEN,
                                            self.what("waiting for the previous stage"), nodes=before)
            pos = work[self.stage]
            if pos == IDLE:
                continue
            nodes = flight.level(pos)
            if self.stage == 0:
                hidden = comm.recv((1, len(nodes), self.d), torch.float32, 0, TAG_HIDDEN, s.step_timeout_s,
                                   self.what("waiting for the entering token"))
            elif inbox_nodes is None or not set(nodes) <= set(inbox_nodes):
                raise comm.PipelineFailure(self.what(f"expected nodes {nodes} at position {pos}, holds "
                                                     f"{inbox_nodes}"))
            else:   # the rows of the nodes a prune kept, in the level's order
                hidden = inbox if nodes == inbox_nodes else inbox[:, [inbox_nodes.index(nd) for nd in nodes]]
            visible = None if probe else level_mask(self.rows, nodes, flight, self.device)
            self._run(hidden, torch.full((len(nodes),), pos), capture, probe=probe, argmax=c.argmax,
                      visible=visible)
            if not probe:
                self.rows.append(nodes, pos)
