"""Distillation throughput and memory on SmolLM2 (n=5, L_s=1, 16k draft vocabulary).

For each sequence length (a fresh process each, so peak RSS is clean): tokens/s of the teacher forward alone
(the frozen target keeping the needed layers, plus its head at the loss positions) and of a whole training step
(teacher + module forward/backward + AdamW), and the step's peak memory above the loaded models.

    python -m bench.train_speed [--lengths 512 1024 2048] [--repeats 3] [--out docs/results/train_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def measure(length: int, repeats: int) -> dict:
    import torch

    from spd.models.module import SpeculationModule
    from spd.targets.loading import load_target
    from spd.targets.stages import StagedTarget
    from spd.train.objective import kd_loss, teacher_pass

    loaded = load_target("smollm2")
    staged = StagedTarget(loaded.model, 5)
    g = torch.Generator().manual_seed(0)
    draft = torch.randperm(loaded.model.config.vocab_size, generator=g)[:16384].sort().values
    module = SpeculationModule.from_target(staged, 1, draft_to_target=draft).train()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, length), generator=g)
    batch = {"input_ids": ids, "valid": torch.ones(1, length, dtype=torch.bool),
             "loss_mask": torch.ones(1, length, dtype=torch.bool)}
    occ = torch.tensor([5])

    def teacher_only():
        return teacher_pass(staged, batch, draft)

    def train_step():
        teacher = teacher_pass(staged, batch, draft)
        loss, _ = kd_loss(module(teacher.hidden, occ, batch["valid"]), teacher)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    teacher_only()  # warm-up (allocator, kernels); the step warm-up also creates AdamW state
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train_step()
    t_teacher = min(_time(teacher_only) for _ in range(repeats))
    t_step = min(_time(train_step) for _ in range(repeats))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"length": length, "teacher_tokens_per_s": length / t_teacher, "train_tokens_per_s": length / t_step,
            "train_over_teacher": t_teacher / t_step, "peak_rss_mib": peak / 1024,
            "step_peak_above_models_mib": (peak - base_rss) / 1024}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/results/train_speed.json")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.repeats)))
        return 0
    rows = []
    for length in args.lengths:
        proc = subprocess.run([sys.executable, __file__, "--child", str(length), "--repeats", str(args.repeats)],
                              capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    growth = [b["step_peak_above_models_mib"] / a["step_peak_above_models_mib"] for a, b in zip(rows, rows[1:])]
    result = {"target": "SmolLM2-135M-Instruct", "n": 5, "module_layers": 1, "draft_vocab": 16384, "rows": rows,
              "step_memory_growth_per_doubling": growth}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(json.dumps({"step_memory_growth_per_doubling": growth}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
