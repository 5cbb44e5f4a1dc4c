"""`spd-infer eval` and `spd-infer report`: the benchmark harness and its tables and plots."""

from __future__ import annotations

import os
import sys


def cmd_eval(args) -> int:
    from spd.cli import quiet_libraries
    from spd.config import load_config
    from spd.eval.config import EvalConfig
    from spd.paths import check_checkpoint_dir

    cfg = load_config(EvalConfig, args.config, args.overrides)
    check_checkpoint_dir(cfg.checkpoint, cfg.method)
    quiet_libraries()
    from spd.eval.harness import run_eval  # after the config is checked: bad input is refused before torch loads

    summary = run_eval(cfg, log=lambda msg: print(f"[eval] {msg}", file=sys.stderr))
    print(f"[eval] {summary['run']['label']} T={cfg.temperature:g}: {headline(summary['overall'])}, "
          f"{summary['overall']['samples']} samples -> {os.path.abspath(cfg.output_dir)}", file=sys.stderr)
    return 0


def headline(overall: dict) -> str:
    """L′acc for the pipelined drafters, τ for EAGLE-3's chain; pooled, then the mean of per-sample ratios."""
    name, key = ("τ", "tau") if "tau_pooled" in overall else ("L′acc", "eal")
    return (f"{name} (pooled) {overall[f'{key}_pooled']:.3f}, mean of per-sample ratios "
            f"{overall[f'{key}_mean_of_ratios']:.3f}")


def cmd_report(args) -> int:
    from spd.cli import quiet_libraries
    from spd.eval.report import load_run, report_command

    quiet_libraries()
    for path in report_command(args.dirs, args.out):
        print(path)
    for directory in args.dirs:
        run = load_run(directory)
        print(f"{directory}: {run['run']['label']} {headline(run['overall'])}", file=sys.stderr)
    return 0
