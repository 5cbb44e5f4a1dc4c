"""Train the speculation module by distillation from the frozen target.

    deepspeed train/run.py --config configs/train/debug.yaml [key=value ...]
    python train/run.py --config configs/train/debug.yaml output_dir=outputs/debug
    torchrun --nproc_per_node 2 train/run.py --config ...
"""

import argparse
import os
import sys

import torch  # noqa: E402  (decides DeepSpeed's accelerator before deepspeed is imported)

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv=None) -> int:
    from spd.config import load_config
    from spd.errors import run_command
    from spd.train.config import TrainConfig

    parser = argparse.ArgumentParser(prog="train/run.py")
    parser.add_argument("--config", default=None)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    def body() -> int:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        from spd.train.loop import train  # after the config is checked: bad input is refused before DeepSpeed loads

        train(cfg)
        return 0

    return run_command("train/run.py", body)


if __name__ == "__main__":
    sys.exit(main())
