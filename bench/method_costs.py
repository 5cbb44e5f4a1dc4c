"""Measured-cost speedups of several eval runs, their costs timed back to back in one process.

Each `spd-infer eval` times its own stages, head, module and verification at its end; runs made at different times
on a shared machine see different loads. This script re-times every run's module on one target in one process
(the same `spd.eval.calibrate.calibrate`, so SPD drafts beside the step and PPSD / the output-state ablation
after it; `calibrate_chain` for EAGLE-3's cycle at the run's m; `calibrate_rows` for FlowSpec's and PipeDec's
steps, priced by the rows each stage ran, through a session opened from the run's own config) and recomputes each
run's measured-cost speedup from its pooled α (EAGLE-3: τ) per dataset.

    python -m bench.method_costs --run spd=docs/results/eval/greedy_n5_best \
        --run ppsd=docs/results/eval/greedy_n5_ppsd --out docs/results/method_costs_n5.json
`--write-back` stores the re-timed figures in each run's summary.json, so `spd-infer report` tables and plots show
them (`--reuse` takes them from an existing --out without timing again).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from omegaconf import OmegaConf

from spd.eval.config import EvalConfig
from spd.eval.harness import context_of
from spd.eval.output import write_json
from spd.models.checkpoint import load_checkpoint
from spd.drafters.eagle3 import Eagle3Drafter
from spd.eval.calibrate import (calibrate, calibrate_chain, chain_measured_cost_speedup, measured_cost_speedup,
                                rows_calibration, rows_measured_cost_speedup)
from spd.methods import METHODS
from spd.corpora.prompts import load_questions
from spd.session import open_session
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", default=[], help="label=eval output directory (repeatable)")
    ap.add_argument("--reference", action="append", default=[],
                    help="label=eval output directory timed beside the runs but never written back (an earlier "
                         "machine's figures stay in its summary)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-back", action="store_true",
                    help="also store the re-timed costs in each run's summary.json (what `spd-infer report` reads)")
    ap.add_argument("--reuse", action="store_true", help="take the costs from an existing --out instead of timing")
    args = ap.parse_args()
    if not args.run and not args.reference and not args.reuse:
        ap.error("give --run label=DIR (repeatable), or --reuse an existing --out")
    if args.reuse:
        with open(args.out) as f:
            result = json.load(f)
    else:
        result = time_runs(args)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        write_json(args.out, result)
        print(f"wrote {args.out}")
    if args.write_back:
        for label, timed in result["runs"].items():
            if not timed.get("reference"):
                write_back(timed["eval_dir"], timed, args.out)
    return 0


def write_back(directory: str, timed: dict, source: str) -> None:
    """Replace the run's own measured-cost speedups (often timed under load) by the re-timed ones, saying so."""
    path = os.path.join(directory, "summary.json")
    with open(path) as f:
        summary = json.load(f)
    summary["speedup"]["measured_cost"] = timed["measured_cost"]
    summary["speedup"]["calibration"] = {**timed["calibration"], "retimed_by": f"bench/method_costs.py -> {source}"}
    write_json(path, summary)
    print(f"updated {path}")


def time_runs(args) -> dict:
    loaded = load_target("smollm2")
    result = {"threads": torch.get_num_threads(), "runs": {}}
    specs = [(spec, False) for spec in args.run] + [(spec, True) for spec in args.reference]
    for (label, directory), reference in ((spec.split("=", 1), ref) for spec, ref in specs):
        with open(os.path.join(directory, "summary.json")) as f:
            summary = json.load(f)
        run = summary["run"]
        groups = {**summary["datasets"], "overall": summary["overall"]}
        if METHODS[run["method"]].rows_vary:   # FlowSpec, PipeDec: each step priced by the rows its stages ran
            cal = time_rows(directory, summary, args.repeats)
            figures = {"eal_pooled": {k: v["eal_pooled"] for k, v in groups.items()},
                       "measured_cost": {k: rows_measured_cost_speedup(v["alpha_pooled"], v["step_rows"], cal)
                                         for k, v in groups.items()}}
        else:
            cal, figures = time_module(loaded, run, groups, args.repeats)
        result["runs"][label] = {"eval_dir": directory, "label": run["label"], "method": run["method"],
                                 "T": run["temperature"], "reference": reference, **figures, "calibration": cal}
        print(json.dumps({label: {k: v for k, v in result["runs"][label].items() if k != "calibration"}}))
    return result


def time_module(loaded, run: dict, groups: dict, repeats: int) -> tuple[dict, dict]:
    """SPD / PPSD / output states (`calibrate`) or EAGLE-3's cycle (`calibrate_chain`), with the run's module."""
    staged = StagedTarget(loaded.model, run["n"], run["stage_bounds"])
    module = load_checkpoint(run["checkpoint"], staged, loaded).eval()
    params = SamplingParams(run["temperature"], run["top_k"] if run["temperature"] else 0, run["top_p"])
    if run["method"] == "eagle3":   # a chain cycle: m drafts, one verify forward, the drafter's update
        cal = calibrate_chain(staged, Eagle3Drafter(module, staged.embed), params, run["draft_length"],
                              repeats=repeats, width=run.get("W", 1), budget=run.get("tree_nodes"))
        return cal, {"tau_pooled": {k: v["tau_pooled"] for k, v in groups.items()},
                     "measured_cost": {k: chain_measured_cost_speedup(v["tau_pooled"], cal) for k, v in groups.items()}}
    cal = calibrate(staged, module, params, repeats=repeats, width=run.get("W", 1))
    return cal, {"eal_pooled": {k: v["eal_pooled"] for k, v in groups.items()},
                 "measured_cost": {k: measured_cost_speedup(v["alpha_pooled"], cal) for k, v in groups.items()}}

def time_rows(directory: str, summary: dict, repeats: int) -> dict:
    """FlowSpec / PipeDec: a session opened from the run's own config times each step's rows; FlowSpec's tree
    growth on the run's first prompt and its decode, as the eval did."""
    cfg = OmegaConf.merge(OmegaConf.structured(EvalConfig), summary["meta"]["config"])
    session = open_session(cfg)
    with open(os.path.join(directory, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    work = [(ds, q) for ds in cfg.datasets for q in load_questions(ds)[: cfg.limit]]
    return rows_calibration(session, summary["overall"]["step_rows"], context_of(session.loaded.tokenizer, work, samples),
                            repeats)


if __name__ == "__main__":
    sys.exit(main())
