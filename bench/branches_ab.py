"""Do Self-Draft's branches pay beside the default by the clock? The default CPU configuration (`method=suffix W=4
datastore=answers+sharegpt`, priced with this machine's row costs) against the same with `suffix_branches=true`
(spd.drafters.suffix_branches: N = `--branches` branches of up to L = `--branch-length` tokens, their G-grams a
priced source, their rows riding where the pricing says they pay), and the suite's AR, taking turns on every prompt
(bench/wallclock_turns.decode_interleaved, as bench/wallclock.py times its field), greedy and T = 1 (top-k 50, keyed
draws, one seed per prompt). Every greedy row is checked against AR's tokens, every sampled row against AR's keyed
samples.

Reported per set and temperature: tokens/s and the ratio of the two drafted rows (pooled, and the geometric mean of
the per-prompt ratios), each against AR, τ, and for the branched row the share of cycles that ran branch rows and
the branch rows a cycle.

    python -m bench.branches_ab --sets everyday,eval --limit 4 --everyday-limit 12 --max-new-tokens 128 \\
        --out docs/results/branches_ab.json

The figure's page: docs/speed-cpu.md, "What was tried and did not pay" (or "What each part of the default buys").
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import torch

from bench.wallclock_sets import prompt_set, summarise_set
from bench.wallclock_turns import decode_interleaved, params_for, seed_of
from spd.decoding import Request, eos_ids_of
from spd.drafters.selfdraft import DraftBranches
from spd.drafters.suffix import Retrieval, SuffixDrafter
from spd.drafters.suffix_branches import BRANCHES, SuffixBranchesDrafter
from spd.engine import build_decoder
from spd.eval.output import write_json
from spd.methods import AR, CHAIN
from spd.pricing import RowCosts
from spd.retrieval import open_datastore
from spd.targets.loading import load_target
from spd.targets.row_costs import _cpu_name, cached_row_costs
from spd.targets.stages import StagedTarget


def rows_for(args, loaded, staged, eos, store) -> tuple[list[dict], list, list]:
    """(row fields, run(key, ids), drafter) for AR, the default and the default with branches, at every T."""
    side = args.branches * args.branch_length
    profile = cached_row_costs(staged, args.tree_nodes + 1 + side)        # one curve, measured together
    default_costs = RowCosts(profile.seconds[: args.tree_nodes + 1])       # what the default prices with
    fields, runs, drafters = [], [], []
    for temperature in args.temperatures:
        params = params_for(temperature)

        def run(decoder, params=params):
            return lambda key, ids: decoder.generate(ids, Request(args.max_new_tokens, params, seed_of(key)))

        common = {"temperature": temperature, "runtime": "single process", "processes": 1,
                  "threads_per_process": torch.get_num_threads()}
        fields.append({"method": "ar", **common})
        runs.append(run(build_decoder(AR, staged, eos)))
        drafters.append(None)
        for branched in (False, True):
            if branched:
                drafter = SuffixBranchesDrafter(DraftBranches(args.branches, args.branch_length, args.gram), 1, 8,
                                                profile, retrieval=store)
            else:
                drafter = SuffixDrafter(1, 8, default_costs, retrieval=store)
            decoder = build_decoder(CHAIN, staged, eos, drafter, draft_length=args.suffix_length, width=args.width,
                                    tree_nodes=args.tree_nodes)
            fields.append({"method": "suffix", **common, "W": args.width, "tree_nodes": args.tree_nodes,
                           "draft_length": args.suffix_length, "datastore": args.datastore,
                           "suffix_branches": branched, "row_costs_s": list(profile.seconds)})
            runs.append(run(decoder))
            drafters.append(drafter)
    return fields, runs, drafters


def paired(rows: list[dict], temperature: float, set_name: str) -> dict:
    """The branched row against the default: pooled tokens/s, and the geometric mean of the per-prompt ratios."""
    def row(method, branched=None):
        return next(r for r in rows if r["set"] == set_name and r["temperature"] == temperature and
                    r["method"] == method and (branched is None or r.get("suffix_branches") == branched))
    ar, plain, branched = row("ar"), row("suffix", False), row("suffix", True)
    per = [branched["per_prompt_tokens_per_s"][k] / plain["per_prompt_tokens_per_s"][k]
           for k in plain["per_prompt_tokens_per_s"]]
    return {"set": set_name, "temperature": temperature, "ar_tokens_per_s": ar["tokens_per_s"],
            "default_vs_ar": plain["tokens_per_s"] / ar["tokens_per_s"],
            "branches_vs_ar": branched["tokens_per_s"] / ar["tokens_per_s"],
            "branches_vs_default": branched["tokens_per_s"] / plain["tokens_per_s"],
            "branches_vs_default_geomean": math.exp(sum(map(math.log, per)) / len(per)),
            "tau_default": plain.get("tau"), "tau_branches": branched.get("tau"),
            "branch_cycle_share": branched.get("branch_cycle_share"),
            "branch_rows_per_cycle": branched.get("branch_rows_per_cycle"),
            "branches_kept": branched.get("sources", {}).get(BRANCHES),
            "equal_ar": {"default": plain.get("greedy_equals_ar", plain.get("sampled_equals_ar")),
                         "branches": branched.get("greedy_equals_ar", branched.get("sampled_equals_ar"))}}


def table(pairs: list[dict]) -> str:
    lines = ["| set, T | AR tok/s | default / AR | with branches / AR | **with / without** (per-prompt geomean) | "
             "τ without / with | cycles with branch rows | branch rows a cycle | = AR |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in pairs:
        lines.append(f"| {p['set']}, {p['temperature']:g} | {p['ar_tokens_per_s']:.1f} | {p['default_vs_ar']:.3f}× | "
                     f"{p['branches_vs_ar']:.3f}× | **{p['branches_vs_default']:.3f}×** "
                     f"({p['branches_vs_default_geomean']:.3f}×) | {p['tau_default']:.3f} / {p['tau_branches']:.3f} | "
                     f"{p['branch_cycle_share']:.1%} | {p['branch_rows_per_cycle']:.2f} | "
                     f"{p['equal_ar']['default']} / {p['equal_ar']['branches']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--sets", default="everyday,eval")
    ap.add_argument("--limit", type=int, default=10, help="first prompts of each eval set")
    ap.add_argument("--everyday-limit", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--datastore", default="answers+sharegpt")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--suffix-length", type=int, default=15)
    ap.add_argument("--branches", type=int, default=6)
    ap.add_argument("--branch-length", type=int, default=6)
    ap.add_argument("--gram", type=int, default=4)
    ap.add_argument("--out", default="docs/results/branches_ab.json")
    args = ap.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    loaded = load_target(args.target)
    staged, eos = StagedTarget(loaded.model, 1), eos_ids_of(loaded.model.config, loaded.tokenizer)
    store = Retrieval(open_datastore(args.datastore, loaded.tokenizer, loaded.model.config.vocab_size)) \
        if args.datastore else None
    rows, sets, pairs = [], {}, []
    for name in args.sets.split(","):
        prompts = prompt_set(name, args, loaded.tokenizer)
        fields, runs, drafters = rows_for(args, loaded, staged, eos, store)
        results = decode_interleaved(prompts, runs)
        mine = []
        for row, result, drafter in zip(fields, results, drafters):
            row.update(result, set=name)
            if drafter is not None:
                row["priced_out_share"] = drafter.priced_out / max(drafter.cycles, 1)
            if isinstance(drafter, SuffixBranchesDrafter):
                row["branch_cycle_share"] = drafter.branch_cycles / max(drafter.cycles, 1)
                row["branch_rows_per_cycle"] = drafter.branch_rows / max(drafter.cycles, 1)
            mine.append(row)
        sets[name] = summarise_set(mine, prompts, args)
        rows += mine
        pairs += [paired(rows, t, name) for t in args.temperatures]
        write_json(args.out, {"pairs": pairs, "rows": rows, "sets": sets})     # a set at a time
    report = {"pairs": pairs, "rows": rows, "sets": sets, "max_new_tokens": args.max_new_tokens,
              "cpu": _cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
              "machine": platform.machine(), "torch": torch.__version__,
              "command": " ".join(["python", "-m", "bench.branches_ab", *sys.argv[1:]])}
    write_json(args.out, report)
    print(table(pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
