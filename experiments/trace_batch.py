"""Eval's greedy trace recording, one prompt at a time against `batch_size` prompts per forward,
in one run on one machine: the wall time of each, and whether the traces are the same (tokens; where they differ,
the target's top-2 margin at the first difference, a near-tie when under 1e-4).

    OMP_NUM_THREADS=2 python -m experiments.trace_batch --limit 10 --max-new-tokens 512 --batch-sizes 8 \
        --out docs/results/trace_batch.json

--limit prompts per data set (10: 30 prompts over the three sets); the layers stored are the shipped n = 5 layout's.

The figure's page: docs/evaluation.md, "Recording the traces in batches".
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from tqdm import tqdm

from spd.decoding import eos_ids_of
from spd.eval.fast import record_greedy_trace, record_greedy_traces
from spd.layout import needed_layers
from spd.corpora.prompts import chat_prompt_ids, load_questions
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

NEAR_TIE = 1e-4


def compare(solo, batched) -> dict:
    """Equal, or where the first difference is and the solo trace's margin there."""
    if solo.tokens == batched.tokens:
        return {"equal": True}
    at = next((i for i, (a, b) in enumerate(zip(solo.tokens, batched.tokens)) if a != b),
              min(len(solo.tokens), len(batched.tokens)))
    margin = solo.margins[at] if at < len(solo.margins) else None
    return {"equal": False, "first_difference": at, "margin": margin,
            "near_tie": margin is not None and margin < NEAR_TIE}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--limit", type=int, default=10, help="prompts per data set")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch-sizes", default="8", help="comma-separated")
    ap.add_argument("--n", type=int, default=5, help="the layout whose layers the traces store")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_target(args.target)
    staged = StagedTarget(loaded.model, args.n)
    eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
    layers = needed_layers(staged.bounds)
    prompts = [chat_prompt_ids(loaded.tokenizer, q["turns"][0])
               for ds in ("mt_bench", "gsm8k", "humaneval") for q in load_questions(ds)[: args.limit]]
    start = time.perf_counter()
    solo = [record_greedy_trace(staged, p, args.max_new_tokens, eos, layers) for p in tqdm(prompts, desc="one at a time")]
    solo_s = time.perf_counter() - start
    tokens = sum(len(t.tokens) for t in solo)
    result = {"command": " ".join(sys.argv), "target": loaded.name, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(), "tokens": tokens,
              "one_at_a_time_s": solo_s, "batched": {}}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        start = time.perf_counter()
        batched = [None] * len(prompts)
        for index, trace, _ in tqdm(record_greedy_traces(staged, prompts, args.max_new_tokens, eos, layers,
                                                          batch_size), total=len(prompts), desc=f"batch {batch_size}"):
            batched[index] = trace
        seconds = time.perf_counter() - start
        rows = [compare(a, b) for a, b in zip(solo, batched)]
        result["batched"][str(batch_size)] = {
            "seconds": seconds, "speedup": solo_s / seconds, "equal": sum(r["equal"] for r in rows),
            "different": [dict(r, prompt=i) for i, r in enumerate(rows) if not r["equal"]],
            "different_not_near_tie": sum(not r["equal"] and not r["near_tie"] for r in rows)}
        print(f"batch {batch_size}: {seconds:.0f} s against {solo_s:.0f} s ({solo_s / seconds:.2f}x), "
              f"{result['batched'][str(batch_size)]['equal']}/{len(prompts)} traces equal")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
