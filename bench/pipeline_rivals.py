"""SPD's nearest rivals by the clock: FlowSpec's segments and PipeDec's draft-model stage beside SPD and
plain decoding, every figure from one run on this machine.

Rows: the suite's AR in one process on every core (the fastest plain decoding here, docs/results.md) and, over the
same stage processes setup (`runtime=distributed`, n stages, threads = cores // processes), SPD with the shipped
module of that n (draft_source=lookup+module), FlowSpec (`method=flowspec`) and PipeDec (`method=pipedec`), each at
T = 0 and T = 1 (top-k 50) on each of --sets: the first --limit prompts of each eval set and/or the everyday set's
first --everyday-limit (chat template, --max-new-tokens, stopping at EOS), each set against its own AR run. Per row: tokens/s and its ratio to AR, L′acc (n · tokens / steps), tokens per step, steps, flushes
(rollbacks), rows each stage ran per step, the acceptance of each draft source, each row's worst prompt against AR;
every greedy row is checked token for token against AR.

    python -m bench.pipeline_rivals --limit 10 --max-new-tokens 128 --out docs/results/pipeline_rivals.json
    python -m bench.pipeline_rivals --sets eval,everyday --limit 10 --max-new-tokens 256 \
        --out docs/results/pipeline_rivals_256.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from spd.runtime.ar import ARDecoder
from spd.config import GenerateConfig, load_config
from spd.decoding import Request, eos_ids_of
from spd.engine import open_engine
from spd.eval.output import write_json
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from bench.turns import decode_all, params_for, seed_of
from bench.prompt_sets import prompt_set


def method_rows(args, prompts, method: str, keys: list[str]) -> list[dict]:
    n = args.n
    overrides = [f"target={args.target}", f"method={method}", f"n={n}", "runtime=distributed",
                 f"controller={args.controller}", *keys]
    cfg = load_config(GenerateConfig, None, overrides)
    rows = []
    with open_engine(cfg) as engine:
        for temperature in args.temperatures:
            params = params_for(temperature)
            pooled = {"flushes": 0, "stage_rows": [0] * n}

            def run(key, ids):
                out = engine.decoder.generate(ids, Request(args.max_new_tokens, params, seed_of(key)))
                pooled["flushes"] += out.stats.rollbacks + out.stats.restarts
                pooled["stage_rows"] = [a + b for a, b in zip(pooled["stage_rows"], out.stats.stage_rows)]
                return out

            result = decode_all(prompts, run)
            rows.append({"method": method, "keys": keys, "n": n, "runtime": "distributed",
                         "controller": args.controller, "processes": engine.stages.world,
                         "temperature": temperature, **result, "eal": n * result["alpha"],
                         "flushes": pooled["flushes"],
                         "rows_per_step": [rows_ / result["K"] for rows_ in pooled["stage_rows"]]})
            print(json.dumps({k: rows[-1][k] for k in ("method", "temperature", "tokens_per_s", "eal", "sources")}),
                  file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--controller", default="first_stage")
    ap.add_argument("--sets", default="eval", help="eval and/or everyday (comma-separated)")
    ap.add_argument("--limit", type=int, default=10, help="first prompts of each eval set")
    ap.add_argument("--everyday-limit", type=int, default=30, help="first prompts of the everyday set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--spd", default="draft_source=lookup+module", help="SPD's keys (';'-separated)")
    ap.add_argument("--flowspec", default="W=2;segment=4;tree_nodes=8", help="FlowSpec's keys (';'-separated)")
    ap.add_argument("--pipedec", default="W=4;children=4;draft_layers=1", help="PipeDec's keys (';'-separated)")
    ap.add_argument("--out", default="docs/results/pipeline_rivals.json")
    args = ap.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    loaded = load_target(args.target)
    sets = {name: prompt_set(name, args, loaded.tokenizer) for name in args.sets.split(",") if name}
    torch.set_num_threads(args.cores)
    report = {"sets": {}, "max_new_tokens": args.max_new_tokens, "cores": args.cores,
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
              "command": " ".join(["python", *sys.argv])}
    for name, prompts in sets.items():
        report["sets"][name] = {"prompts": len(prompts), "rows": one_set(args, loaded, prompts)}
        write_json(args.out, report)           # each finished set is kept if a later one is cut off
        print_table(name, report["sets"][name]["rows"])
    return 0


def one_set(args, loaded, prompts) -> list[dict]:
    ar = ARDecoder(StagedTarget(loaded.model, 1), eos_ids_of(loaded.model.config, loaded.tokenizer))
    rows = []
    for temperature in args.temperatures:
        result = decode_all(prompts, lambda key, ids: ar.generate(
            ids, Request(args.max_new_tokens, params_for(temperature), seed_of(key))))
        rows.append({"method": "ar", "runtime": "single process", "processes": 1, "threads_per_process": args.cores,
                     "temperature": temperature, **result})
    for method, keys in (("spd", args.spd), ("flowspec", args.flowspec), ("pipedec", args.pipedec)):
        rows += method_rows(args, prompts, method, [k for k in keys.split(";") if k])
    for row in rows:
        base = next(r for r in rows if r["method"] == "ar" and r["temperature"] == row["temperature"])
        row["speedup_vs_ar"] = row["tokens_per_s"] / base["tokens_per_s"]
        ratios = {key: rate / base["per_prompt_tokens_per_s"][key]
                  for key, rate in row["per_prompt_tokens_per_s"].items()}
        worst = min(ratios, key=ratios.get)
        row["worst_prompt_vs_ar"], row["worst_prompt"] = ratios[worst], worst
        if row["temperature"] == 0:
            reference = next(r for r in rows if r["method"] == "ar" and r["temperature"] == 0)["outputs"]
            row["greedy_equal_ar"] = sum(row["outputs"][k] == reference[k] for k in reference)
    return rows


def print_table(name: str, rows: list[dict]) -> None:
    print(f"\n{name}\n| method | keys | T | tokens/s | vs AR | L′acc | tokens/step | steps | flushes | "
          "rows/step (stage 1) | greedy = AR | worst prompt | drafts kept |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        kept = ", ".join(f"{s} {v['accepted']}/{v['verified']}" for s, v in r["sources"].items())
        print(f"| {r['method']} | {' '.join(r.get('keys', []))} | {r['temperature']:g} | {r['tokens_per_s']:.2f} | "
              f"{r['speedup_vs_ar']:.2f} | {r.get('eal', float('nan')):.3f} | {r.get('alpha', float('nan')):.3f} | "
              f"{r.get('K', '—')} | {r.get('flushes', '—')} | "
              f"{r['rows_per_step'][0] if 'rows_per_step' in r else 1:.2f} | {r.get('greedy_equal_ar', '—')} | "
              f"{r['worst_prompt_vs_ar']:.2f} | {kept} |")

if __name__ == "__main__":
    sys.exit(main())
