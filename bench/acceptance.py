"""Greedy L'acc of a module on the eval prompts (first `--limit` of each set), with the exact fast evaluator.

The target's greedy traces are cached per (target fingerprint, stage bounds, prompts, max_new_tokens), so
evaluating many checkpoints costs one batched module pass per prompt and occupancy.

    python -m bench.acceptance --checkpoint outputs/smollm2_n5/checkpoint [--limit 20] [--max-new-tokens 128]
    python -m bench.acceptance --n 5            # randomly initialised module (the untrained baseline)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
from tqdm import tqdm

from spd.models.checkpoint import load_checkpoint, read_checkpoint_config
from spd.decoding import eos_ids_of
from spd.eval.fast import GreedyTrace, record_greedy_trace
from spd.eval.fast_trace import fast_greedy_stats
from spd.metrics import pooled_eal
from spd.models.module import SpeculationModule
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget


def load_traces(loaded, staged, limit, max_new, cache_dir):
    prompts = [(ds, q["question_id"], q["turns"][0]) for ds in DATASETS for q in load_questions(ds)[:limit]]
    key = hashlib.sha256(json.dumps([loaded.fingerprint, staged.bounds, prompts, max_new]).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"greedy-traces-{key}.pt")
    if os.path.exists(path):
        return prompts, torch.load(path, map_location=staged.device)
    eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
    traces = []
    for _, _, text in tqdm(prompts, desc="target greedy traces"):
        t = record_greedy_trace(staged, chat_prompt_ids(loaded.tokenizer, text), max_new, eos)
        traces.append({"prompt_ids": t.prompt_ids, "tokens": t.tokens, "margins": t.margins,
                       "hidden": t.hidden})
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(traces, path + ".tmp")
    os.replace(path + ".tmp", path)
    return prompts, traces


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-dir", default="outputs/cache")
    ap.add_argument("--out", default=None)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    loaded = load_target(args.target, torch.float32, args.device)
    n = read_checkpoint_config(args.checkpoint)["n"] if args.checkpoint else args.n
    staged = StagedTarget(loaded.model, n)
    module = load_checkpoint(args.checkpoint, staged, loaded) if args.checkpoint else \
        SpeculationModule.from_target(staged, 1)
    module.eval()
    prompts, traces = load_traces(loaded, staged, args.limit, args.max_new_tokens, args.cache_dir)
    per_dataset, rows = {}, []
    for (ds, qid, _), raw in zip(prompts, traces):
        trace = GreedyTrace(raw["prompt_ids"], raw["tokens"], raw["hidden"],
                            raw["margins"])
        res = fast_greedy_stats(module, trace)
        per_dataset.setdefault(ds, []).append(res["stats"])
        rows.append({"dataset": ds, "question_id": qid, **res["stats"].as_dict(), "decisive_occupancy": res["decisive_occupancy"]})
    all_stats = [s for v in per_dataset.values() for s in v]
    occupancy = {}
    for r in rows:
        for a, c in r["decisive_occupancy"].items():
            occupancy[a] = occupancy.get(a, 0) + c
    total = sum(occupancy.values())
    result = {"checkpoint": args.checkpoint, "n": n, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "eal_pooled": pooled_eal(all_stats),
              "eal_per_dataset": {ds: pooled_eal(v) for ds, v in per_dataset.items()},
              "decisive_occupancy_distribution": {a: c / total for a, c in sorted(occupancy.items())}}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump({**result, "samples": rows}, f, indent=2)
        os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
