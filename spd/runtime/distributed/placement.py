"""Where each process of the pipeline runs and how its tensors travel: the process group's backends, a stage
process's device, and what a hand-off goes over the wire as. Pure functions of the device, the dtype and the
environment, so that the CUDA rules are tested on a CPU."""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

import torch

HOST = torch.device("cpu")


class Wire(NamedTuple):
    """What a tensor travels as: `tensor.to(*wire)` puts it on the wire, a receive allocates its buffer so."""

    device: torch.device
    dtype: torch.dtype


def gpus_apart(device: str | torch.device, processes: int, count: int | None = None) -> bool:
    """Whether hand-offs can go GPU to GPU: a CUDA run where each of this machine's `processes` has a GPU of its
    own, the controller (local rank 0) on cuda:0. NCCL refuses two ranks on one GPU, so anything else keeps
    going through the host."""
    device = torch.device(device)
    if device.type != "cuda" or device.index not in (None, 0):
        return False
    count = torch.cuda.device_count() if count is None else count
    return processes <= count


def backend(gpus: bool) -> str:
    """The process group's backends. Host data (the setup, control messages) always travels over gloo; NCCL joins
    only for hand-offs between GPUs, and creates its communicators on first use, so an unused one costs nothing."""
    return "cpu:gloo,cuda:nccl" if gpus else "gloo"


def stage_device(device: str | torch.device, stage: int, env: Mapping[str, str] | None = None,
                 count: int | None = None) -> torch.device:
    """The device of the stage process running `stage` (0-based) of a run on `device`: on CUDA, the GPU of its
    local rank (torchrun sets LOCAL_RANK, and so does the controller for the processes it spawns), else one GPU
    per stage in turn."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    env = os.environ if env is None else env
    count = torch.cuda.device_count() if count is None else count
    if "LOCAL_RANK" in env:
        return torch.device("cuda", int(env["LOCAL_RANK"]) % max(count, 1))
    if count > 1:
        return torch.device("cuda", stage % count)
    return device


def on_wire(device: torch.device, dtype: torch.dtype, gpus: bool) -> Wire:
    """What a tensor held on `device` in `dtype` travels as. Between GPUs (NCCL) it stays where it is, in its own
    dtype; through the host (gloo) it goes as float32, which holds every half-precision value exactly and which
    gloo carries in every torch build."""
    device = torch.device(device)
    if gpus and device.type == "cuda":
        return Wire(device, dtype)
    return Wire(HOST, torch.float32)
