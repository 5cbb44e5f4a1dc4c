"""`spd-infer eval` and `spd-infer report`: the benchmark harness and its tables and plots."""

from __future__ import annotations

import sys


def cmd_eval(args) -> int:
    from spd.config import load_config
    from spd.eval.config import EvalConfig

    cfg = load_config(EvalConfig, args.config, args.overrides)
    from spd.eval.harness import run_eval  # after the config is checked: bad input is refused before torch loads

    summary = run_eval(cfg, log=lambda msg: print(f"[eval] {msg}", file=sys.stderr))
    overall = summary["overall"]
    print(f"[eval] {summary['run']['label']} T={cfg.temperature:g}: L′acc (pooled) {overall['eal_pooled']:.3f}, "
          f"mean of per-sample ratios {overall['eal_mean_of_ratios']:.3f}, {overall['samples']} samples -> "
          f"{cfg.output_dir}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from spd.eval.report import load_run, report_command

    for path in report_command(args.dirs, args.out):
        print(path)
    for directory in args.dirs:
        run = load_run(directory)
        print(f"{directory}: {run['run']['label']} L′acc {run['overall']['eal_pooled']:.3f}", file=sys.stderr)
    return 0
