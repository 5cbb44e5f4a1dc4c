"""bench/wallclock.py's rows of SPD in stage processes (`--ns`, `runtime=distributed`): each stage its own process,
so these rows run one after another, not in turns with the single-process field (their threads per process differ).
Each row carries the calibrated cost model beside the clock (spd.eval.calibrate)."""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

from spd.models.checkpoint import read_checkpoint_config
from spd.config import GenerateConfig, load_config
from spd.decoding import Request
from spd.drafters.base import Drafter, WrappedDrafter
from spd.engine import build_decoder
from spd.eval.calibrate import calibrate, measured_cost_speedup, step_time
from spd.methods import AR, PIPELINE
from spd.runtime.stages import open_stages, threads_for
from spd.session import open_session
from spd.targets.stages import StagedTarget
from bench.wallclock_turns import decode_all, params_for, seed_of


class TimedDrafter(WrappedDrafter):
    """The real drafter, with the time it spends drafting (the controller's share of every step) recorded."""

    def __init__(self, inner: Drafter):
        super().__init__(inner)
        self.seconds, self.calls = 0.0, 0

    def propose(self, view, choose):
        start = time.perf_counter()
        out = self.inner.propose(view, choose)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def matching_checkpoint(checkpoints: list[str], n: int, bounds: list[int]) -> str | None:
    for path in checkpoints:
        cfg = read_checkpoint_config(path)
        if cfg["n"] == n and cfg["stage_bounds"] == bounds:
            return path
    return None


def distributed_rows(args, prompts, n: int, kind: str, cores: int, full_model, controller: str) -> list[dict]:
    processes = n if controller == "first_stage" else n + 1
    overrides = [f"target={args.target}", f"n={n}", "runtime=distributed", f"controller={controller}",
                 f"threads_per_stage={max(1, cores // processes)}"]
    if kind == "balanced":
        overrides.append("stage_bounds=balanced")
    elif kind != "even":     # explicit inner bounds, e.g. 19 or 10/20 (a trained module's own)
        overrides.append(f"stage_bounds=[{kind.replace('/', ',')}]")
    probe = open_session(load_config(GenerateConfig, None, overrides))  # resolves the bounds
    checkpoint = matching_checkpoint(args.checkpoint, n, probe.staged.bounds)
    bounds_override = [f"stage_bounds={probe.staged.bounds[1:-1]}"] if n > 1 else []
    cfg = load_config(GenerateConfig, None, [o for o in overrides if not o.startswith("stage_bounds")]
                      + bounds_override + ([f"checkpoint={checkpoint}"] if checkpoint else []))
    session = open_session(cfg)
    bounds = session.staged.bounds
    threads = threads_for(n, cfg.threads_per_stage, controller == "first_stage")
    torch.set_num_threads(threads)
    calibration = {}
    staged_full = StagedTarget(full_model, n, bounds)
    for temperature in args.temperatures:
        calibration[temperature] = calibrate(staged_full, session.module, params_for(temperature), context=128,
                                             repeats=10)
    base = {"n": n, "bounds": kind, "stage_bounds": bounds, "threads_per_process": threads, "processes": processes,
            "controller": controller,
            # the session drafts with the shipped module for this n and bounds when none is given (spd.models.shipped)
            "module": "trained" if checkpoint else "shipped" if session.spec.module.checkpoint else "untrained",
            "checkpoint": checkpoint or session.spec.module.checkpoint,
            "balance": probe.caches.balance}
    rows = []
    capture = session.drafter().layers_needed(bounds)
    with open_stages(session.staged, session.spec.runtime, capture, session.caches.cache_dir,
                     session.spec.tree.width) as stages:
        messages = stages.time_messages()
        comm = {"message_us_per_step_median": statistics.median(messages) * 1e6,
                "message_us_per_step_p90": sorted(messages)[int(0.9 * len(messages))] * 1e6}
        for temperature, source in itertools.product(args.temperatures, args.draft_sources):
            params = params_for(temperature)
            session.spec = replace(session.spec, draft_source=source)
            drafter = TimedDrafter(session.drafter())
            decoder = build_decoder(PIPELINE, session.staged, session.eos_ids, drafter, stages=stages)
            result = decode_all(prompts, lambda key, ids: decoder.generate(
                ids, Request(args.max_new_tokens, params, seed_of(key))))
            cal = calibration[temperature]
            step_s, _ = step_time(cal["stage_s"], cal["head_s"], cal["verify_s"], cal["module_s"],
                                  hosted=controller == "first_stage")
            rows.append({**base, **comm, "method": "spd", "draft_source": source, "runtime": "distributed",
                         "temperature": temperature, **result, "eal": n * result["alpha"],
                         "s_per_step": result["seconds"] / result["K"],
                         "module_s_per_step": drafter.seconds / max(1, drafter.calls),
                         "calibrated": {k: cal[k] for k in ("stage_s", "head_s", "module_s", "verify_s", "ar_token_s",
                                                            "step_s", "bottleneck")},
                         "calibrated_tokens_per_s": result["alpha"] / step_s,
                         "calibrated_step_s": step_s,
                         "calibrated_speedup_vs_ar_same_threads": measured_cost_speedup(result["alpha"],
                                                                                        {**cal, "step_s": step_s})})
            print(json.dumps({k: rows[-1][k] for k in ("n", "bounds", "draft_source", "temperature", "tokens_per_s",
                                                        "eal", "sources")}), file=sys.stderr)
        if 0 in args.temperatures and not args.skip_pipeline_ar:
            decoder = build_decoder(AR, session.staged, session.eos_ids, stages=stages)
            result = decode_all(prompts, lambda key, ids: decoder.generate(
                ids, Request(args.max_new_tokens, params_for(0))))
            rows.append({**base, **comm, "method": "ar", "runtime": "distributed", "temperature": 0, **result})
    return rows
