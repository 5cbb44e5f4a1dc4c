"""Every runtime once, in `RUNTIMES`: its name, how its executor is opened, and what it can do. Config checks, the
session, the engine, eval and the server ask a runtime's capabilities here instead of comparing names, so a runtime
is added as one entry (and its executor, under spd/runtime/). Torch-free: the configs read it before anything heavy is imported."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from spd.errors import UserError


@dataclass(frozen=True)
class Runtime:
    name: str
    help: str                 # what it runs, after "runs" in `--help` and errors
    # "module:function" of a context manager (staged, RuntimeOptions, capture, cache_dir, width, slots) ->
    # StageExecutor; the
    # in-process opener builds `steps` (spd.runtime.stages.EXECUTORS: eager, or as CUDA graphs)
    opener: str = "spd.runtime.stages:open_in_process"
    steps: tuple[str, str] | None = None   # in-process executor kinds without / with cuda_graphs=true
    processes: bool = False   # one process per stage: the stages load their own layers, the controller holds none,
                              # and a failed step leaves the pipeline gone (a server stops)
    cuda: bool = False        # needs a CUDA device
    chains: bool = False      # draft-then-verify methods (the whole target in this process) run on it
    reference: bool = False   # the eager, stage-after-stage reference: the plain AR loop, exact fast evaluation,
                              # cost calibration and many requests per forward in this process
    device_step: bool = False  # each cycle one function of device tensors (spd.runtime.device_step), the whole
                               # target in this process; the methods that have one (spd.methods) run on it

    @property
    def graphs(self) -> bool:
        """cuda_graphs=true can capture its steps (its stage steps, or its device step)."""
        return self.device_step or self.steps is not None and self.steps[1] != self.steps[0]

    def executor_kind(self, cuda_graphs: bool) -> str:
        """The in-process executor (spd.runtime.stages.EXECUTORS) this runtime runs with `cuda_graphs`."""
        assert self.steps is not None, f"runtime={self.name} runs no in-process executor"
        return self.steps[1] if cuda_graphs else self.steps[0]

    def opens(self):
        """The function that opens this runtime's executor, imported on first use."""
        module, _, attribute = self.opener.partition(":")
        return getattr(importlib.import_module(module), attribute)


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    Runtime("local", "the stages one after another in this process (the reference; cuda_graphs=true: each stage "
            "step a CUDA graph)", steps=("local", "graphs"), chains=True, reference=True),
    Runtime("distributed", "one process per stage, spawned here or started by torchrun",
            opener="spd.runtime.distributed.launch:open_pipeline", processes=True),
    Runtime("streams", "each stage on a CUDA stream in this process", steps=("streams", "streams_graphs"), cuda=True),
    Runtime("device", "each cycle as one step of device tensors in this process (acceptance and rollback on the "
            "device, one read a cycle; cuda_graphs=true: captured as one CUDA graph; compile=true: through "
            "torch.compile)", steps=("local", "local"), chains=True, device_step=True),
)}


def runtime(name: str) -> Runtime:
    if name not in RUNTIMES:
        raise UserError(f"runtime={name!r} is not one of: {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


def eager_reference(options) -> bool:
    """A spec's runtime options (spd.spec.RuntimeOptions) decode on the eager reference executor (no CUDA graphs):
    what the plain AR loop, the exact fast evaluator, calibration and in-process batching need."""
    return runtime(options.name).reference and not options.cuda_graphs
