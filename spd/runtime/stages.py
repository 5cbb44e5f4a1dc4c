"""Which executor runs the stages of a decoding run: `runtime=local` (this process; with `cuda_graphs=true` each
stage step a CUDA graph), `runtime=streams` (this process, one CUDA stream per stage) or `runtime=distributed`
(one process per stage, spawned here or started by torchrun), as a context manager that always tidies up."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from spd.errors import UserError
from spd.runtime.executor import StageExecutor
from spd.runtime.local import LocalStages
from spd.target.stages import StagedTarget

from spd.config import RUNTIMES


def check_runtime(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise UserError(f"runtime={runtime!r} is not one of: {', '.join(RUNTIMES)}")


def threads_for(n: int, threads_per_stage: int | None) -> int:
    """n stage processes + the controller share the cores without oversubscription, unless told otherwise."""
    if threads_per_stage is not None:
        if threads_per_stage < 1:
            raise UserError(f"threads_per_stage={threads_per_stage} must be >= 1")
        return threads_per_stage
    return max(1, (os.cpu_count() or 1) // (n + 1))


@contextmanager
def open_stages(staged: StagedTarget, cfg, capture: list[int], cache_dir: str | None = None):
    """Yield a StageExecutor for `staged` (in-process) or for stage processes loading `cache_dir`'s target."""
    check_runtime(cfg.runtime)
    if cfg.runtime == "streams":
        from spd.runtime.streams import StreamStages

        yield StreamStages(staged, cfg.cuda_graphs)
        return
    if cfg.runtime == "local":
        if getattr(cfg, "cuda_graphs", False):
            from spd.runtime.streams import GraphStages

            yield GraphStages(staged)
        else:
            yield LocalStages(staged)
        return
    import torch.distributed as dist

    from spd.runtime.distributed.launch import close_pipeline, join_launched_pipeline, start_local_pipeline
    from spd.runtime.distributed.protocol import Setup

    threads = threads_for(staged.n, cfg.threads_per_stage)
    torch.set_num_threads(threads)
    setup = Setup(cache_dir=cache_dir, n=staged.n, bounds=staged.bounds, capture=sorted(set(capture) - {0}),
                  dtype=cfg.dtype, device=cfg.device, threads=threads, step_timeout_s=cfg.timeout_s)
    executor: StageExecutor | None = None
    graceful = True
    try:
        if dist.is_initialized():  # torchrun started every rank (infer/run.py)
            executor = join_launched_pipeline(staged, setup)
        else:
            executor = start_local_pipeline(staged, setup, cfg.master_addr, cfg.master_port)
        yield executor
    except BaseException:
        graceful = False
        raise
    finally:
        close_pipeline(executor, graceful)
