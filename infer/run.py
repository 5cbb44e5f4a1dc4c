"""Distributed SPD under torchrun, the twin of `deepspeed train/run.py`:

    torchrun --nproc-per-node <n+1> infer/run.py target=smollm2 n=5 prompt="..." [key=value ...]

Rank 0 is the controller and takes `spd-infer generate`'s keys (runtime=distributed implied); ranks 1..n each run
one stage. With `--nproc-per-node <n>` the controller runs stage 1 itself and ranks 1..n-1 run stages 2..n (what
two cores want for n = 2). torchrun's multi-node flags (--nnodes, --node-rank, --master-addr, --master-port) span
machines.
"""

import datetime
import os
import sys


def main() -> int:
    import torch.distributed as dist

    from spd.runtime.distributed.placement import backend, gpus_apart
    from spd.runtime.distributed.worker import run_stage_process

    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" not in os.environ:
        print("infer/run.py: error: start it with torchrun --nproc-per-node <n+1> or <n> (or use spd-infer generate "
              "runtime=distributed, which starts the processes itself)", file=sys.stderr)
        return 2
    # the run's device is not known yet (rank 0 reads it from the keys): NCCL joins wherever each of this machine's
    # processes could have a GPU of its own, and carries the hand-offs only if the run is on CUDA
    gpus = gpus_apart("cuda", int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    dist.init_process_group(backend(gpus),
                            timeout=datetime.timedelta(seconds=float(os.environ.get("SPD_CONNECT_TIMEOUT_S", 300))))
    if rank > 0:
        return run_stage_process(rank)
    from spd.cli import main as cli_main
    from spd.runtime.distributed import launch

    try:
        return cli_main(["generate", "runtime=distributed", *sys.argv[1:]])
    finally:
        if dist.is_initialized() and not launch.setup_sent():
            launch.abort_stages("the controller refused the run")  # the stages exit instead of waiting
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
