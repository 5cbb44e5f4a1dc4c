"""Proof of the chains' fast evaluators on SmolLM2 (EAGLE-3's; with --method lookup the context lookup's, with
--method suffix the priced context statistics', each prompt with a fresh drafter on this machine's row costs) (the chain's counterpart of bench/fast_eval_check.py): for every
prompt and every draft length m, greedy chain decoding's N, cycles and accepted drafts per cycle from the fast
evaluator (cached target trace + one training-time-test pass) must equal the chain runtime's, and the runtime's
tokens must equal the target's greedy trace. A difference is acceptable only where a top-2 logit margin below 1e-4
(module or target) explains it (the same rule and helpers as bench/fast_eval_check.py); every difference is listed with its margins.

    python -m bench.fast_eval_check_chain --checkpoint outputs/eagle3_679k/checkpoint --ms 3,5,7 \
        --limit 10 --max-new-tokens 64
    python -m bench.fast_eval_check_chain --method lookup --ms 7 --limit 80 --max-new-tokens 16 \
        --out docs/results/fast_eval_check_chain_lookup.json
    python -m bench.fast_eval_check_chain --checkpoint CKPT --ms 5 --width 4 --tree-nodes 16   # EAGLE-3's trees
    python -m bench.fast_eval_check_chain --method suffix --ms 15 --width 4 --limit 80 --max-new-tokens 16
    python -m bench.fast_eval_check_chain --method suffix --ms 15 --width 4 --limit 80 --max-new-tokens 16 \
        --datastore sharegpt --out docs/results/fast_eval_check_chain_datastore.json
Resumable: finished (m, prompt) rows are kept in <out>l and skipped. Writes docs/results/fast_eval_check_chain.json.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from spd.models.checkpoint import load_checkpoint
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import Retrieval, SuffixDrafter
from spd.corpora.retrieval import open_datastore
from spd.engine import build_decoder
from spd.eval.output import write_json
from spd.eval.traces import TraceCache
from spd.eval.fast_chain import fast_chain_stats, fast_lookup_stats, fast_tree_stats
from spd.methods import CHAIN
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.row_costs import cached_row_costs
from spd.targets.stages import StagedTarget

from bench.fast_eval_check import eval_prompts, finished_rows, unexplained   # this folder: the SPD check's helpers


def summary(stats) -> list:
    return [stats.N, stats.cycles, stats.accepted, stats.accepted_per_cycle]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "lookup", "suffix"])
    ap.add_argument("--checkpoint", help="a trained EAGLE-3 module (method=eagle3)")
    ap.add_argument("--lookup-ngrams", default="2,8", help="method=lookup: shortest,longest suffix matched")
    ap.add_argument("--ms", default="3,5,7", help="draft lengths m")
    ap.add_argument("--width", type=int, default=1, help="W > 1: EAGLE-3's dynamic tree (fast_tree_stats)")
    ap.add_argument("--tree-nodes", type=int, default=16, help="W > 1: drafted nodes per cycle")
    ap.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cache-dir", default="outputs/cache/traces")
    ap.add_argument("--datastore", default=None, help="method=suffix: with this datastore's candidates too (sharegpt)")
    ap.add_argument("--out", default="docs/results/fast_eval_check_chain.json")
    args = ap.parse_args()
    if args.method == "eagle3" and not args.checkpoint:
        ap.error("method eagle3 needs --checkpoint")
    lookup = tuple(int(x) for x in args.lookup_ngrams.split(","))
    loaded = load_target("smollm2")
    staged = StagedTarget(loaded.model, 1)
    module = load_checkpoint(args.checkpoint, staged, loaded).eval() if args.method == "eagle3" else None
    retrieval = Retrieval(open_datastore(args.datastore, loaded.tokenizer, loaded.model.config.vocab_size)) \
        if args.datastore else None
    rows_path = args.out + "l"
    done = finished_rows(rows_path, "m")
    prompts = eval_prompts(loaded.tokenizer, args.limit)
    traces = TraceCache(args.cache_dir, loaded, staged, args.max_new_tokens, module.layers_needed() if module else [])
    with open(rows_path, "a") as sink:
        for m in [int(x) for x in args.ms.split(",")]:
            drafter = Eagle3Drafter(module, staged.embed) if module else LookupDrafter(*lookup)
            tree = args.width > 1
            runtime = build_decoder(CHAIN, staged, traces.eos, drafter, width=args.width, draft_length=m,
                                    tree_nodes=args.tree_nodes if tree else None)
            costs = cached_row_costs(staged, 1 + (args.tree_nodes if tree else m)) if args.method == "suffix" else None
            for ds, qid, ids in tqdm(prompts, desc=f"m={m} runtime vs fast", mininterval=30):
                if (m, ds, str(qid)) in done:
                    continue
                trace, _ = traces.get(ds, qid, ids)
                with torch.no_grad():
                    if costs is not None:       # a fresh drafter per prompt on both sides: the predictor starts equal
                        runtime = build_decoder(CHAIN, staged, traces.eos,
                                                SuffixDrafter(1, lookup[1], costs, retrieval=retrieval),
                                                width=args.width, draft_length=m,
                                                tree_nodes=args.tree_nodes if tree else None)
                        fast = {**fast_tree_stats(SuffixDrafter(1, lookup[1], costs, retrieval=retrieval), trace, m,
                                                  args.width, args.tree_nodes if tree else m), "min_module_margin": None}
                    elif tree and module:    # the replay has no margins of its own; the target's still decide
                        fast = {**fast_tree_stats(Eagle3Drafter(module, staged.embed), trace, m, args.width,
                                                  args.tree_nodes), "min_module_margin": None}
                    elif module:
                        fast = fast_chain_stats(module, trace, m)
                    else:
                        fast = {**fast_lookup_stats(trace, *lookup, m, width=args.width,
                                                    budget=args.tree_nodes if tree else None), "min_module_margin": None}
                    slow = runtime.generate(ids, Request(args.max_new_tokens, SamplingParams()))
                f, s = summary(fast["stats"]), summary(slow.stats)
                row = {"m": m, "W": args.width, "dataset": ds, "question_id": qid, "checkpoint": args.checkpoint, "method": args.method,
                       "fast": f, "runtime": s, "equal": f == s, "accepted_drafts": slow.stats.accepted,
                       "datastore": args.datastore, "sources": slow.stats.sources,
                       "runtime_equals_target": slow.token_ids == trace.tokens,
                       "min_module_margin": fast["min_module_margin"], "min_target_margin": fast["min_target_margin"]}
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                done[(m, ds, str(qid))] = row
    rows = list(done.values())
    differences, unexplained_rows = unexplained(rows)
    per_m = {}
    for r in rows:
        entry = per_m.setdefault(str(r["m"]), {"prompts": 0, "equal": 0, "runtime_equals_target": 0, "cycles": 0,
                                               "accepted_drafts": 0, "checkpoint": r["checkpoint"]})
        entry["prompts"] += 1
        entry["cycles"] += r["runtime"][1]
        entry["accepted_drafts"] += r["accepted_drafts"]
        entry["equal"] += r["equal"]
        entry["runtime_equals_target"] += r["runtime_equals_target"]
        for source, (verified, accepted) in (r.get("sources") or {}).items():   # drafts verified and kept, per source
            total = entry.setdefault("sources", {}).setdefault(source, [0, 0])
            total[0], total[1] = total[0] + verified, total[1] + accepted
    result = {"max_new_tokens": args.max_new_tokens, "limit_per_dataset": args.limit, "per_m": per_m,
              "differences": differences, "unexplained_differences": len(unexplained_rows)}
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "differences"}, indent=1))
    return 0 if not unexplained_rows else 1


if __name__ == "__main__":
    sys.exit(main())
