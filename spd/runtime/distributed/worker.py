"""A stage process: `python -m spd.runtime.distributed.worker` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
SPD_BACKEND (the group's backends) set (spawned by the controller), or rank > 0 under torchrun via infer/run.py.
Exit 0 when told to stop, 1 with one line when the pipeline fails, 2 (quietly) when the controller refused the
run."""

from __future__ import annotations

import datetime
import os
import signal
import sys


def run_stage_process(rank: int) -> int:
    import torch.distributed as dist

    from spd.runtime.distributed.comm import PipelineFailure
    from spd.runtime.distributed.stage import StageServer, receive_setup

    try:
        setup = receive_setup()
        if setup.abort:
            return 2
        StageServer(setup, rank).serve()
        return 0
    except PipelineFailure as exc:
        _die(f"spd-infer: error: {exc}; exiting")
    except RuntimeError as exc:  # the group itself broke (e.g. the controller vanished during setup)
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _die(f"spd-infer: error: stage process rank {rank}: {line}; exiting")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _say(line: str) -> None:
    """One write of the whole line: sibling stages share the stderr, and print's separate newline write let two
    stages' lines run together."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def _die(line: str) -> None:
    """One line, then exit at once: tearing down a broken group can block on peers that are gone."""
    _say(line)
    os._exit(1)


def main() -> int:
    # Ctrl-C / SIGTERM end a stage process at once, without a traceback; the controller reports.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from spd.runtime.distributed.launch import watch_parent

    watch_parent()
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group(os.environ.get("SPD_BACKEND", "gloo"), rank=rank,
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=float(os.environ.get("SPD_CONNECT_TIMEOUT_S", 60))))
    except RuntimeError as exc:
        _say(f"spd-infer: error: stage process rank {rank} could not join the pipeline "
             f"({(str(exc).splitlines() or ['?'])[0]})")
        return 1
    return run_stage_process(rank)


if __name__ == "__main__":
    sys.exit(main())
