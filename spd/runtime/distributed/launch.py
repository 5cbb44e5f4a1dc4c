"""Forming the process group: spawn the stage processes on this machine (`spd-infer ... runtime=distributed`), or
join the ones torchrun started (`torchrun --nproc-per-node <n+1> infer/run.py`, or <n> when the controller runs
stage 1), and tidy up either way."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from spd.errors import UserError
from spd.runtime.distributed.comm import PipelineFailure
from spd.runtime.distributed.controller import DistributedStages
from spd.runtime.distributed.placement import backend, gpus_apart
from spd.runtime.distributed.protocol import Setup, world_size
from spd.runtime.executor import StageExecutor
from spd.runtime.stages import hosts_first_stage, launched_world, threads_for
from spd.spec import RuntimeOptions
from spd.targets.stages import StagedTarget


def check_port(addr: str, port: int) -> int:
    """The controller will host the rendezvous here: refuse at once, before any process exists, if it cannot.
    Returns the port (a free one when port is 0)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((addr, port))
            return sock.getsockname()[1]
    except socket.gaierror:
        raise UserError(f"master_addr={addr!r} is not a known host; use an address of this machine, e.g. "
                        "127.0.0.1") from None
    except OSError as exc:
        if exc.errno == 98 or "in use" in str(exc):
            raise UserError(f"master_port={port} is in use on {addr}; pick another master_port= (0 = any free "
                            "port)") from None
        raise UserError(f"cannot host the rendezvous at {addr}:{port} ({exc.strerror}); the controller runs on "
                        "this machine, so master_addr= must be one of its addresses (e.g. 127.0.0.1)") from None


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class StageProcesses:
    """The stage processes this controller spawned (ranks 1..world - 1; rank r runs stage r, 1-based, or r + 1
    when the controller runs stage 1)."""

    def __init__(self, n: int, hosted: bool, addr: str, port: int, threads: int, backends: str = "gloo"):
        world = world_size(n, hosted)
        env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   OMP_NUM_THREADS=str(threads), SPD_PARENT_PID=str(os.getpid()), SPD_BACKEND=backends)
        self.n, self.hosted = n, hosted
        self.procs = []
        for rank in range(1, world):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "spd.runtime.distributed.worker"],
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdin=subprocess.DEVNULL))

    def describe_failure(self, grace_s: float = 2.0) -> str | None:
        """The first stage process that ended badly, in words (waiting briefly: a socket error can beat the exit)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code not in (None, 0):
                    return (f"stage {rank + int(self.hosted)}/{self.n} (rank {rank}, pid {proc.pid}) "
                            f"{_exit_text(code)}; the pipeline was stopped")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def interrupted(self, grace_s: float = 0.5) -> bool:
        """Whether a stage process ended on SIGINT (a terminal's Ctrl-C reaches the whole process group)."""
        deadline = time.monotonic() + grace_s
        while True:
            if any(proc.poll() == -signal.SIGINT for proc in self.procs):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def join(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


def start_local_pipeline(target: StagedTarget, setup: Setup, addr: str = "127.0.0.1", port: int = 0) -> DistributedStages:
    """Spawn the stage processes here and form the group with this process as the controller (rank 0)."""
    port = check_port(addr, port)
    backends = backend(setup.nccl)
    processes = StageProcesses(setup.n, setup.hosted, addr, port, setup.threads, backends)
    try:
        _form_group(processes, addr, port, world_size(setup.n, setup.hosted), setup.idle_timeout_s, backends)
        return DistributedStages(target, setup, processes)
    except PipelineFailure as exc:
        dead = processes.describe_failure()
        processes.kill()
        _leave_group()
        raise PipelineFailure(dead or str(exc)) from None
    except BaseException:
        processes.kill()
        _leave_group()
        raise


def _form_group(processes: StageProcesses, addr: str, port: int, world: int, timeout_s: float,
                backends: str = "gloo") -> None:
    """init_process_group blocks in C++ until every rank has joined, where neither Ctrl-C nor a stage that died
    while importing torch can reach it: the controller would wait out the timeout (a day). So the group is formed
    in a helper thread while this one watches the stage processes and stays interruptible."""
    failed: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(backends, init_method=f"tcp://{addr}:{port}", rank=0, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except BaseException as exc:  # handed to the main thread
            failed.append(exc)

    helper = threading.Thread(target=join, name="spd-form-group", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)
        if processes.interrupted(grace_s=0):
            raise KeyboardInterrupt
        dead = processes.describe_failure(grace_s=0)
        if dead and helper.is_alive():
            raise PipelineFailure(dead.replace("; the pipeline was stopped", " before joining the process group"))
    if failed:
        raise failed[0]


_setup_sent = False


def setup_sent() -> bool:
    """Whether this controller has told the torchrun-started stages what to do (or that there is nothing to do)."""
    return _setup_sent


def join_launched_pipeline(target: StagedTarget, setup: Setup) -> DistributedStages:
    """torchrun started every rank; this one (rank 0) is the controller."""
    global _setup_sent
    world = dist.get_world_size()
    if world != world_size(setup.n, setup.hosted):   # open_stages chose `hosted` from this world size
        abort_stages(f"world size {world} does not fit n={setup.n}")
        raise UserError(f"n={setup.n} stages need {world_size(setup.n, setup.hosted)} processes, but torchrun "
                        f"started {world}")
    _setup_sent = True
    return DistributedStages(target, setup)


def abort_stages(reason: str) -> None:
    """Tell stage processes waiting for their setup that there is no run (they exit quietly)."""
    global _setup_sent
    _setup_sent = True
    dist.broadcast_object_list([Setup(cache_dir="", n=0, bounds=[], capture=[], abort=reason)], src=0)


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def close_pipeline(executor: DistributedStages | None, graceful: bool = True) -> None:
    """graceful: tell the stages to stop (exit 0). Otherwise (a failure, Ctrl-C) just leave the group: every stage
    then sees its connection to the controller close, says so in one line and exits non-zero."""
    try:
        if executor is not None:
            executor.close() if graceful else executor.abort()
    finally:
        _leave_group()
        if executor is not None and executor.processes is not None:
            executor.processes.join(timeout_s=10.0)


def watch_parent() -> None:
    """A spawned stage process ends when its controller does, even if the controller could not say goodbye."""
    parent = int(os.environ.get("SPD_PARENT_PID", "0"))
    if not parent:
        return

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _gpu_hand_offs(device: str, launched: int | None, world: int) -> bool:
    """Whether the hand-offs go GPU to GPU: judged from this machine's processes (torchrun's LOCAL_WORLD_SIZE, as
    every node is taken to hold as many), and under torchrun only if infer/run.py formed the group with NCCL."""
    if launched is None:
        return gpus_apart(device, world)
    here = int(os.environ.get("LOCAL_WORLD_SIZE", launched))
    return gpus_apart(device, here) and "nccl" in str(dist.get_backend())


@contextmanager
def open_pipeline(staged: StagedTarget, options: RuntimeOptions, capture: list[int], cache_dir: str | None = None,
                  width: int = 1, slots: int = 1):
    """runtime=distributed: stage processes loading `cache_dir`'s target, spawned here or joined under torchrun;
    torn down on exit (gracefully unless the body raised)."""
    launched = launched_world()
    d = options.distributed
    hosted = hosts_first_stage(d.controller, staged.n, options.device, launched)
    threads = threads_for(staged.n, d.threads_per_stage, hosted)
    torch.set_num_threads(threads)
    setup = Setup(cache_dir=cache_dir, n=staged.n, bounds=staged.bounds, capture=sorted(set(capture) - {0}),
                  dtype=options.dtype, weights=options.weights, device=options.device, threads=threads, step_timeout_s=d.timeout_s,
                  hosted=hosted, width=width, slots=slots,
                  nccl=_gpu_hand_offs(options.device, launched, world_size(staged.n, hosted)))
    executor: StageExecutor | None = None
    graceful = True
    try:
        if dist.is_initialized():  # torchrun started every rank (infer/run.py)
            executor = join_launched_pipeline(staged, setup)
        else:
            executor = start_local_pipeline(staged, setup, d.master_addr, d.master_port)
        yield executor
    except BaseException:
        graceful = False
        raise
    finally:
        close_pipeline(executor, graceful)
