"""EAGLE-3's first draft against SPD at occupancy a = 1: the same information, who uses it better?

SPD's module at a = 1 drafts x_{t+1} from full-depth features of every position before t and the embedding of x_t;
EAGLE-3's first draft after verified position t-1 reads exactly that (its step-0 rows: f_i and the embedding of
x_{i+1}, i <= t-1). On the target's own greedy traces of the first --limit prompts of each eval set (the diagnosis
set of docs/results.md), for every drafted position t: does SPD's a = 1 draft equal the target's x_{t+1}? Does
EAGLE-3's first draft? Also EAGLE-3's unrolled steps j = 1..6 (teacher-forced tokens, its own hidden states), and
each pipelined module's acceptance at every occupancy.

    python -m experiments.first_draft --spd e5=outputs/diag/e5/checkpoint --eagle3 eagle3=outputs/diag/eagle3/checkpoint \
        --out docs/results/first_draft_214k.json

The figure's page: docs/evaluation.md, "EAGLE-3".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from spd.eval.output import write_json
from spd.models.checkpoint import load_checkpoint, read_checkpoint_config
from spd.eval.fast import GreedyTrace
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

from bench.acceptance import load_traces
from experiments.depth_diagnosis import acceptance_per_occupancy, drafted_positions


@torch.no_grad()
def eagle_step_acceptance(module, staged: StagedTarget, traces: list[GreedyTrace], steps: int) -> dict[int, float]:
    """Per unrolled step j: the fraction of drafted positions t whose draft (step j at row t-1-j, the chain's j-th
    draft after verified position t-1-j with the true tokens before it) equals the target's x_{t+1}."""
    hits, total = torch.zeros(steps), torch.zeros(steps)
    for trace in traces:
        seq = trace.prompt_ids + trace.tokens
        ids = torch.tensor([seq[:-1]], device=staged.device)
        _, hidden = staged.forward_all(ids, None, capture=frozenset(module.layers_needed()))
        logits = module.forward_ttt(hidden, steps=steps)
        positions, truth = drafted_positions(trace)
        for j in range(steps):
            rows = positions - 1 - j
            keep = rows >= 0
            draft = logits[j][0, rows[keep]].argmax(-1)
            if module.draft_to_target is not None:
                draft = module.draft_to_target[draft]
            hits[j] += float((draft.cpu() == truth[keep]).sum())
            total[j] += int(keep.sum())
    return {j: float(hits[j] / total[j]) for j in range(steps)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spd", action="append", default=[], help="label=path of a pipelined module (repeatable)")
    ap.add_argument("--eagle3", action="append", default=[], help="label=path of an EAGLE-3 module (repeatable)")
    ap.add_argument("--limit", type=int, default=10, help="prompts per eval set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-dir", default="outputs/cache")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not args.spd:
        ap.error("give at least one --spd module: its bounds pick the traces")
    loaded = load_target("smollm2")
    first = read_checkpoint_config(args.spd[0].split("=", 1)[1])
    staged = StagedTarget(loaded.model, first["n"], first["stage_bounds"])
    _, raw = load_traces(loaded, staged, args.limit, args.max_new_tokens, args.cache_dir)
    traces = [GreedyTrace(r["prompt_ids"], r["tokens"], r["hidden"], r["margins"]) for r in raw]
    result = {"limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "positions": sum(len(t.tokens) - 1 for t in traces), "pipelined": {}, "eagle3": {}}
    for label, path in (spec.split("=", 1) for spec in args.spd):
        module = load_checkpoint(path, staged, loaded).eval()
        meta = read_checkpoint_config(path)
        result["pipelined"][label] = {"checkpoint": path, "method": meta.get("method", "spd"),
                                      "train_tokens": meta.get("train_tokens"),
                                      "acceptance_by_occupancy": acceptance_per_occupancy(module, traces, "as_trained")}
        print(json.dumps({label: result["pipelined"][label]}))
    whole = StagedTarget(loaded.model, 1)
    for label, path in (spec.split("=", 1) for spec in args.eagle3):
        module = load_checkpoint(path, whole, loaded).eval()
        meta = read_checkpoint_config(path)
        result["eagle3"][label] = {"checkpoint": path, "train_tokens": meta.get("train_tokens"),
                                   "acceptance_by_step": eagle_step_acceptance(module, whole, traces, 7)}
        print(json.dumps({label: result["eagle3"][label]}))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
