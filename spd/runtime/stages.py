"""Which executor runs the stages of a decoding run: `runtime=local` (this process; with `cuda_graphs=true` each
stage step a CUDA graph), `runtime=streams` (this process, one CUDA stream per stage) or `runtime=distributed`
(one process per stage, spawned here or started by torchrun), as a context manager that always tidies up."""

from __future__ import annotations

import os
from contextlib import contextmanager

from spd.errors import UserError
from spd.runtimes import runtime as runtime_named
from spd.runtime.executor import StageExecutor
from spd.runtime.local import LocalStages
from spd.spec import RuntimeOptions
from spd.targets.stages import StagedTarget


def cores() -> int:
    """CPU cores this process may run on (its affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def launched_world() -> int | None:
    """The torchrun world size when this process is part of one (its size decides where the controller runs)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else None


def hosts_first_stage(controller: str, n: int, device: str, world: int | None = None) -> bool:
    """Whether the controller runs stage 1 itself (n processes) rather than in a process of its own (n + 1).

    `auto`: under torchrun (world given) the world size decides; spawned here, the controller hosts stage 1 on a
    CPU whose cores n + 1 processes would outnumber (a separate controller there measured 1.4x its calibrated
    step, docs/speed-cpu.md "Concurrent stages") and keeps its own process on a GPU or where cores are to spare."""
    if controller == "first_stage" and n < 2:
        raise UserError("controller=first_stage needs n >= 2 (with n=1 nothing would run in a stage process); use "
                        "runtime=local, or controller=own_process")
    if world is not None:
        if world not in (n, n + 1) or (controller == "first_stage" and world != n) or \
                (controller == "own_process" and world != n + 1):
            wanted = {"first_stage": f"{n}", "own_process": f"{n + 1}"}.get(controller, f"{n} or {n + 1}")
            raise UserError(f"n={n} stages need {wanted} processes (one per stage, plus one for the controller "
                            f"unless it runs stage 1), but torchrun started {world}; use --nproc-per-node/--nnodes "
                            f"for {wanted} in all")
        return world == n and n >= 2
    if controller != "auto":
        return controller == "first_stage"
    return n >= 2 and device == "cpu" and n + 1 > cores()


def threads_for(n: int, threads_per_stage: int | None, hosted: bool = False) -> int:
    """The processes (n stages, plus the controller unless it hosts stage 1) share the cores without
    oversubscription, unless told otherwise."""
    if threads_per_stage is not None:
        if threads_per_stage < 1:
            raise UserError(f"threads_per_stage={threads_per_stage} must be >= 1")
        return threads_per_stage
    return max(1, cores() // (n if hosted else n + 1))


# the in-process executors, by what their stage steps are: sliced eager steps (the reference), fixed-shape steps run
# eagerly or as CUDA graphs, one after another or each stage on its own CUDA stream (off CUDA: eagerly, in turn)
EXECUTORS = ("local", "fixed", "graphs", "streams", "streams_graphs")


def stage_executor(kind: str, staged: StagedTarget) -> StageExecutor:
    """An in-process executor of `kind` (EXECUTORS) over `staged`."""
    if kind == "local":
        return LocalStages(staged)
    from spd.runtime.streams import GraphStages, StreamStages

    if kind in ("fixed", "graphs"):
        return GraphStages(staged, cuda_graphs=kind == "graphs")
    if kind in ("streams", "streams_graphs"):
        return StreamStages(staged, cuda_graphs=kind == "streams_graphs")
    raise ValueError(f"executor {kind!r} is not one of {', '.join(EXECUTORS)}")


def reference_kind(kind: str) -> str | None:
    """The executor plain AR relays through to check an executor of `kind` losslessly: the same kind of stage step
    (fixed-shape, as graphs or not); None for the sliced steps, whose reference is the plain eager AR loop."""
    return None if kind == "local" else "graphs" if kind.endswith("graphs") else "fixed"


def executor_kind(runtime: str, cuda_graphs: bool) -> str:
    """What `runtime=` and `cuda_graphs=` of an in-process run ask for."""
    return runtime_named(runtime).executor_kind(cuda_graphs)


def sequences_together(cfg) -> int:   # the command's keys (getattr: not every command has both)
    """How many sequences the stages must hold at once: the command's batch (serve and generate's `max_batch`,
    eval's `batch_size`), 1 where it has none."""
    return max(getattr(cfg, "max_batch", 1), getattr(cfg, "batch_size", 1))


@contextmanager
def open_stages(staged: StagedTarget, options: RuntimeOptions, capture: list[int], cache_dir: str | None = None,
                width: int = 1, slots: int = 1):
    """Yield a StageExecutor for `staged`: the spec's runtime (spd.runtimes.RUNTIMES) opens it, in this process or
    as stage processes loading `cache_dir`'s target. width: the most nodes a stage runs in a step (W; FlowSpec: its
    segments' rows); slots: the sequences it holds at once (a batch)."""
    with runtime_named(options.name).opens()(staged, options, capture, cache_dir, width, slots) as executor:
        yield executor


@contextmanager
def open_in_process(staged: StagedTarget, options: RuntimeOptions, capture: list[int], cache_dir: str | None = None,
                    width: int = 1, slots: int = 1):
    """An in-process runtime's executor: its steps as the spec asks (eager or CUDA graphs)."""
    yield stage_executor(executor_kind(options.name, options.cuda_graphs), staged)
