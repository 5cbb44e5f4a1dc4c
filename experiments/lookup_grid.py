"""Which lookup chain is fastest on this machine? Its greedy cycles replayed exactly over the target's own traces
(spd.eval.fast_chain.fast_lookup_stats), priced with target forwards of 1..m+1 rows timed here.

A CPU does not verify drafts for free (one row ~36 ms, eight rows ~1.3× that on SmolLM2): a draft pays only where
it is likely right, so the shortest match that may draft (lookup_min_ngram) and the drafts per cycle (draft_length)
trade acceptance against rows. For each pair: τ (tokens per target forward), the rows fed, and the predicted
speedup over plain AR = (tokens × cost(1 row)) / Σ cost(rows of each cycle). The traces are the eval's cache
(`spd-infer eval` with the same config records and reuses them). bench/clock.py then checks the pick by the clock.

    python -m experiments.lookup_grid --limit 5 --out docs/results/lookup_grid.json

--widths 1,2,4 adds branching lookups (W > 1, `--tree-nodes` nodes a cycle at most), replayed just as exactly:
whether the alternative continuations earn the rows they add.

The figure's page: docs/speed-cpu.md, "The lookup chain's settings"; docs/rivals.md, "Draft trees (W > 1)".
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from tqdm import tqdm

from spd.config import load_config
from spd.eval.config import EvalConfig
from spd.eval.traces import TraceCache
from spd.eval.fast_chain import fast_lookup_stats
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.session import open_session
from spd.targets.row_costs import measure_row_costs
from spd.eval.output import write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/eval/greedy.yaml")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--min-ngrams", default="1,2,3,4,5,6")
    ap.add_argument("--draft-lengths", default="1,2,4,8,16")
    ap.add_argument("--max-ngram", type=int, default=8)
    ap.add_argument("--widths", default="1", help="draft-tree widths W (1 = the chain)")
    ap.add_argument("--tree-nodes", type=int, default=16, help="W > 1: drafted nodes per cycle at most")
    ap.add_argument("--context", type=int, default=300, help="cached tokens behind the timed forwards")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default="docs/results/lookup_grid.json")
    ap.add_argument("overrides", nargs="*", help="eval config overrides (key=value)")
    args = ap.parse_args()
    cfg = load_config(EvalConfig, args.config, args.overrides)
    session = open_session(cfg)
    traces = TraceCache(cfg.trace_cache_dir, session.loaded, session.staged, cfg.max_new_tokens)
    work = [(ds, q) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    tok = session.loaded.tokenizer
    recorded = [(ds, traces.get(ds, q["question_id"], chat_prompt_ids(tok, q["turns"][0]))[0])
                for ds, q in tqdm(work, desc="traces", unit="prompt")]
    min_ngrams = [int(x) for x in args.min_ngrams.split(",")]
    lengths = [int(x) for x in args.draft_lengths.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    max_rows = max(max(lengths), args.tree_nodes if max(widths) > 1 else 0) + 1
    profile, _ = measure_row_costs(session.staged, max_rows, args.context, args.repeats)
    costs = {rows: seconds for rows, seconds in enumerate(profile.seconds, start=1)}
    grid = []
    for min_n, m, width in itertools.product(min_ngrams, lengths, widths):
        per = {}
        for ds, trace in recorded:
            fast = fast_lookup_stats(trace, min_n, max(min_n, args.max_ngram), m, width=width,
                                     budget=args.tree_nodes if width > 1 else None)
            s = per.setdefault(ds, {"prompts": 0, "N": 0, "cycles": 0, "rows": 0, "cost_s": 0.0, "ar_cost_s": 0.0})
            s["prompts"] += 1
            s["N"] += fast["stats"].N
            s["cycles"] += fast["stats"].cycles
            s["rows"] += sum(fast["rows_per_cycle"])
            s["cost_s"] += sum(costs[r] for r in fast["rows_per_cycle"])
            s["ar_cost_s"] += (fast["stats"].N - 1) * costs[1]    # AR: one forward per token after the prefill's
        total = {k: sum(s[k] for s in per.values()) for k in ("prompts", "N", "cycles", "rows", "cost_s", "ar_cost_s")}
        for s in [*per.values(), total]:
            s["tau"] = (s["N"] - s["prompts"]) / s["cycles"]     # tokens after each prompt's first, per forward
            s["predicted_speedup"] = s["ar_cost_s"] / s["cost_s"]
        grid.append({"lookup_min_ngram": min_n, "draft_length": m, "W": width,
                     "tree_nodes": args.tree_nodes if width > 1 else None, "per_dataset": per, "overall": total})
    best = max(grid, key=lambda g: g["overall"]["predicted_speedup"])
    report = {"grid": grid, "best": {k: best[k] for k in ("lookup_min_ngram", "draft_length", "W")},
              "row_cost_s": costs, "context": args.context, "threads": torch.get_num_threads(),
              "prompts": len(recorded), "max_new_tokens": cfg.max_new_tokens, "lookup_max_ngram": args.max_ngram,
              "command": " ".join(["python", *sys.argv])}
    write_json(args.out, report)
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    costs = report["row_cost_s"]
    lines = [f"Target forward, {report['threads']} threads, {report['context']} cached tokens: " +
             ", ".join(f"{r} row{'s' if r > 1 else ''} {costs[r] * 1e3:.1f} ms" for r in sorted(costs)), "",
             "| lookup_min_ngram | draft_length | W | τ | rows per cycle | predicted speedup vs AR | " +
             " | ".join(f"{ds} τ / speedup" for ds in report["grid"][0]["per_dataset"]) + " |",
             "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(report["grid"][0]["per_dataset"])]
    for g in report["grid"]:
        o = g["overall"]
        lines.append(f"| {g['lookup_min_ngram']} | {g['draft_length']} | {g.get('W', 1)} | {o['tau']:.2f} | "
                     f"{o['rows'] / o['cycles']:.2f} | "
                     f"{o['predicted_speedup']:.2f} | " +
                     " | ".join(f"{s['tau']:.2f} / {s['predicted_speedup']:.2f}" for s in g["per_dataset"].values()) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
