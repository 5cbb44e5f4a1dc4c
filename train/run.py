"""Train the speculation module by distillation from the frozen target.

    deepspeed train/run.py --config configs/train/debug.yaml [key=value ...]
    python train/run.py --config configs/train/debug.yaml output_dir=outputs/debug
    torchrun --nproc_per_node 2 train/run.py --config ...
"""

import argparse
import os
import signal
import sys
import threading

import torch  # noqa: E402  (decides DeepSpeed's accelerator before deepspeed is imported)

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    from spd.cli.keys import KeysParser
    from spd.config import load_config
    from spd.errors import run_command
    from spd.train.config import TrainConfig
    from spd.train.preflight import check_paths

    # --help ends with every key, its default and meaning (the methods from spd.methods), as spd-infer's do
    parser = KeysParser(prog="train/run.py", description="Train the speculation module by distillation from the "
                        "frozen target.", schema=TrainConfig)
    parser.add_argument("--config", default=None)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    def body() -> int:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        check_paths(cfg)  # output_dir (fresh, resumable, or given up) before the target and the data load
        from spd.train.loop import train  # after the config is checked: bad input is refused before DeepSpeed loads

        train(cfg)
        return 0

    # SIGTERM (the deepspeed launcher's answer to Ctrl-C, a scheduler's stop) is Ctrl-C: before training it stops
    # the run with one line and exit 130; while training spd.train.loop.StopRequest saves a resumable state first
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return run_command("train/run.py", body)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
