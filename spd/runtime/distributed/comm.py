"""Point-to-point messages with a deadline: every wait has a timeout, and a failure names who was waited for.

A message goes over the backend of its tensor's device: host tensors over gloo, CUDA tensors over NCCL (when the
group has it, spd.runtime.distributed.placement). gloo keeps the kinds of message apart by tag; NCCL ignores tags
and matches a pair of ranks' messages in the order they were posted, on one stream for both directions, so every
pair posts its CUDA sends and receives in the same order on both sides."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from spd.errors import PipelineFailure  # noqa: F401  (raised here; defined where the CLI can catch it cheaply)
from spd.runtime.distributed.placement import HOST, Wire


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # gloo prefixes its messages with a source location in brackets
    return line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line


def wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PipelineFailure(f"{what}: {_first_line(exc)}") from None


def send(tensor: torch.Tensor, dst: int, tag: int, wire: Wire | None = None):
    """Start sending `tensor`, put on `wire` first (None: host data, sent as it is). The caller waits for the
    returned work before reusing `tensor`. A peer already gone can fail the send at once."""
    tensor = tensor.detach() if wire is None else tensor.detach().to(*wire)
    try:
        return dist.isend(tensor.contiguous(), dst, tag=tag)
    except RuntimeError as exc:
        raise PipelineFailure(f"sending to rank {dst}: {_first_line(exc)}") from None


def recv(shape, dtype, src: int, tag: int, timeout_s: float, what: str, device: torch.device = HOST) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    wait(dist.irecv(buf, src, tag=tag), timeout_s, what)
    return buf


class Pending:
    """A receive posted early (so the transfer overlaps compute), completed later."""

    def __init__(self, shape, dtype, src: int, tag: int, what: str, device: torch.device = HOST, **info):
        self.buf = torch.empty(shape, dtype=dtype, device=device)
        self.work = dist.irecv(self.buf, src, tag=tag)
        self.what = what
        self.info = info

    def get(self, timeout_s: float) -> torch.Tensor:
        wait(self.work, timeout_s, self.what)
        return self.buf
