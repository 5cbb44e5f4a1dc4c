"""Cross-check the exact fast evaluator against the step-by-step runtime on SmolLM2: N, K and rollbacks of
greedy SPD for the same module and prompts must be identical (a module top-2 margin below 1e-4 would explain
a difference; every mismatch is listed with the smallest margins).

    python bench/fast_eval_check.py --checkpoint outputs/smollm2_n5_fast/checkpoint --limit 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

from spd.checkpoint import load_checkpoint, read_checkpoint_config
from spd.decoding import eos_ids_of
from spd.drafters.spd_module import ModuleDrafter
from spd.fast_eval import GreedyTrace, fast_greedy_stats
from spd.module import SpeculationModule
from spd.pipeline import PipelineDecoder
from spd.sampling import SamplingParams
from spd.target.loading import load_target
from spd.target.stages import StagedTarget

sys.path.insert(0, os.path.dirname(__file__))
from acceptance import load_traces  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--limit", type=int, default=2, help="prompts per dataset (from the cached 20-per-set traces)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-dir", default="outputs/cache")
    ap.add_argument("--out", default="bench/results/fast_eval_check.json")
    args = ap.parse_args()
    loaded = load_target("smollm2")
    n = read_checkpoint_config(args.checkpoint)["n"] if args.checkpoint else args.n
    staged = StagedTarget(loaded.model, n)
    module = (load_checkpoint(args.checkpoint, staged, loaded) if args.checkpoint
              else SpeculationModule.from_target(staged, 1)).eval()
    prompts, traces = load_traces(loaded, staged, 20, args.max_new_tokens, args.cache_dir)
    eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
    picked = [(p, t) for i, (p, t) in enumerate(zip(prompts, traces)) if i % 20 < args.limit]
    rows = []
    for (ds, qid, _), raw in tqdm(picked, desc="runtime vs fast"):
        trace = GreedyTrace(raw["prompt_ids"], raw["tokens"], raw["hidden"], raw["margins"])
        fast = fast_greedy_stats(module, trace)
        slow = PipelineDecoder(staged, ModuleDrafter(module), SamplingParams(), eos).generate(
            trace.prompt_ids, args.max_new_tokens)
        f, s = fast["stats"], slow.stats
        rows.append({"dataset": ds, "question_id": qid, "fast": [f.N, f.K, f.rollbacks], "runtime": [s.N, s.K, s.rollbacks],
                     "same_tokens": slow.token_ids == trace.tokens, "equal": [f.N, f.K, f.rollbacks] == [s.N, s.K, s.rollbacks],
                     "min_module_margin": fast["min_module_margin"], "min_target_margin": fast["min_target_margin"]})
    result = {"checkpoint": args.checkpoint, "n": n, "prompts": len(rows), "equal": sum(r["equal"] for r in rows),
              "rows": rows}
    with open(args.out + ".tmp", "w") as fh:
        json.dump(result, fh, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    for r in rows:
        print(r)
    return 0 if result["equal"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
