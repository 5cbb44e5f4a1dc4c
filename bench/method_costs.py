"""Measured-cost speedups of several eval runs, their costs timed back to back in one process.

Each `spd-infer eval` times its own stages, head, module and verification at its end; runs made at different times
on a shared machine see different loads. This script re-times every run's module on one target in one process
(the same `spd.eval.calibrate.calibrate`, so SPD drafts beside the step and PPSD / the output-state ablation
after it; `calibrate_chain` for EAGLE-3's cycle at the run's m) and recomputes each run's measured-cost speedup
from its pooled α (EAGLE-3: τ) per dataset.

    python bench/method_costs.py --run spd=bench/results/eval/greedy_n5_best \
        --run ppsd=bench/results/eval/greedy_n5_ppsd --out bench/results/method_costs_n5.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from spd.eval.output import write_json
from spd.checkpoint import load_checkpoint
from spd.drafters.eagle3 import Eagle3Drafter
from spd.eval.calibrate import calibrate, calibrate_chain, chain_measured_cost_speedup, measured_cost_speedup
from spd.sampling import SamplingParams
from spd.target.loading import load_target
from spd.target.stages import StagedTarget


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="label=eval output directory (repeatable)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    loaded = load_target("smollm2")
    result = {"threads": torch.get_num_threads(), "runs": {}}
    for label, directory in (spec.split("=", 1) for spec in args.run):
        with open(os.path.join(directory, "summary.json")) as f:
            summary = json.load(f)
        run = summary["run"]
        staged = StagedTarget(loaded.model, run["n"], run["stage_bounds"])
        module = load_checkpoint(run["checkpoint"], staged, loaded).eval()
        params = SamplingParams(run["temperature"], run["top_k"] if run["temperature"] else 0, run["top_p"])
        groups = {**summary["datasets"], "overall": summary["overall"]}
        if run["method"] == "eagle3":   # a chain cycle: m drafts, one verify forward, the drafter's update
            cal = calibrate_chain(staged, Eagle3Drafter(module, staged.embed), params, run["draft_length"],
                                  repeats=args.repeats)
            figures = {"tau_pooled": {k: v["tau_pooled"] for k, v in groups.items()},
                       "measured_cost": {k: chain_measured_cost_speedup(v["tau_pooled"], cal)
                                         for k, v in groups.items()}}
        else:
            cal = calibrate(staged, module, params, repeats=args.repeats)
            figures = {"eal_pooled": {k: v["eal_pooled"] for k, v in groups.items()},
                       "measured_cost": {k: measured_cost_speedup(v["alpha_pooled"], cal) for k, v in groups.items()}}
        result["runs"][label] = {"eval_dir": directory, "label": run["label"], "method": run["method"],
                                 "T": run["temperature"], **figures, "calibration": cal}
        print(json.dumps({label: {k: v for k, v in result["runs"][label].items() if k != "calibration"}}))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
