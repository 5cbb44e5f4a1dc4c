"""Curves for one or more training runs: held-out top-1 agreement per occupancy a=1..n and greedy L'acc on the
eval prompts (exact fast evaluator, first --limit of each set), against training tokens, for every kept checkpoint.

    python -m bench.train_curves outputs/smollm2_n5 outputs/smollm2_n5_fast --out docs/figures/train_curves
Writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from spd.models.checkpoint import load_checkpoint, read_checkpoint_config  # noqa: E402
from spd.eval.fast import GreedyTrace
from spd.eval.fast_trace import fast_greedy_stats  # noqa: E402
from spd.metrics import pooled_eal  # noqa: E402
from spd.targets.loading import load_target  # noqa: E402
from spd.targets.stages import StagedTarget  # noqa: E402
from spd.train.data import load_conversations, tokenize_conversations  # noqa: E402
from spd.train.objective import collate, kd_loss, teacher_pass  # noqa: E402

from bench.acceptance import load_traces  # noqa: E402


@torch.no_grad()
def heldout_top1(module, staged, teachers, n):
    per_a = {}
    for batch, teacher in teachers:
        for a in range(1, n + 1):
            logits = module(teacher.hidden, torch.tensor([a]), batch["valid"])
            _, agree = kd_loss(logits, teacher)
            per_a.setdefault(a, []).append(agree)
    return {a: float(torch.cat(v).mean()) for a, v in per_a.items()}


def plot(results: dict, out: str) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, points in results.items():
        name = os.path.basename(run.rstrip("/"))
        x = [p["train_tokens"] / 1e3 for p in points]
        ax1.plot(x, [p["eal"] for p in points], marker="o", label=name)
        for a in points[0]["top1_per_occupancy"]:
            ax2.plot(x, [p["top1_per_occupancy"][a] for p in points], marker=".",
                     label=f"{name} a={a}", linestyle="-" if "fast" in name else "--")
    ax1.set(xlabel="training tokens (thousands)", ylabel="greedy L'acc (60 prompts, 128 tokens)",
            title="Equivalent acceptance length")
    ax2.set(xlabel="training tokens (thousands)", ylabel="held-out top-1 agreement", title="Top-1 per occupancy")
    ax1.legend()
    ax2.legend(fontsize=6, ncol=2)
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="*")
    ap.add_argument("--plot-only", nargs="+", default=None, help="merge earlier <out>.json files into one plot")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--heldout", type=int, default=8, help="held-out conversations for top-1 (from each run's split)")
    ap.add_argument("--cache-dir", default="outputs/cache")
    ap.add_argument("--out", default="docs/figures/train_curves")
    ap.add_argument("--every", type=int, default=1, help="evaluate every k-th kept checkpoint (and the last)")
    args = ap.parse_args()
    if args.plot_only:
        merged = {}
        for path in args.plot_only:
            with open(path) as f:
                merged.update(json.load(f))
        with open(args.out + ".json", "w") as f:
            json.dump(merged, f, indent=2)
        plot(merged, args.out)
        print(f"wrote {args.out}.json and {args.out}.png")
        return 0
    loaded = load_target("smollm2")
    results = {}
    for run in args.runs:
        ckpts = sorted(glob.glob(os.path.join(run, "checkpoints", "step-*")))
        ckpts = [c for i, c in enumerate(ckpts) if i % args.every == args.every - 1 or i == len(ckpts) - 1]
        if not ckpts:
            continue
        cfg0 = read_checkpoint_config(ckpts[0])
        staged = StagedTarget(loaded.model, cfg0["n"], cfg0["stage_bounds"])
        prompts, traces = load_traces(loaded, staged, args.limit, args.max_new_tokens, args.cache_dir)
        with open(os.path.join(run, "config.json")) as f:
            run_cfg = json.load(f)
        # the run's own held-out split: the first `heldout` conversations of its seeded permutation
        convs = load_conversations(run_cfg["data"]["path"], run_cfg["data"]["max_conversations"] + run_cfg["data"]["heldout"])
        order = torch.randperm(len(convs), generator=torch.Generator().manual_seed(run_cfg["seed"])).tolist()
        held = [convs[i] for i in order[: min(args.heldout, run_cfg["data"]["heldout"])]]
        examples = tokenize_conversations(loaded.tokenizer, held, run_cfg["data"]["max_length"], log=lambda m: None)
        points = []
        for path in ckpts:
            module = load_checkpoint(path, staged, loaded).eval()
            meta = read_checkpoint_config(path)
            draft = module.draft_to_target
            teachers = [(b, teacher_pass(staged, b, draft)) for b in (collate([e], 0) for e in examples)]
            stats = []
            for raw in traces:
                trace = GreedyTrace(raw["prompt_ids"], raw["tokens"], raw["hidden"], raw["margins"])
                stats.append(fast_greedy_stats(module, trace)["stats"])
            points.append({"checkpoint": path, "step": meta["step"], "train_tokens": meta.get("train_tokens"),
                           "eal": pooled_eal(stats), "top1_per_occupancy": heldout_top1(module, staged, teachers,
                                                                                        cfg0["n"])})
            print(json.dumps(points[-1]))
        results[run] = points
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json.tmp", "w") as f:
        json.dump(results, f, indent=2)
    os.replace(args.out + ".json.tmp", args.out + ".json")
    plot(results, args.out)
    print(f"wrote {args.out}.json and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
