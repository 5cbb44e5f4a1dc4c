"""By the clock: configurations of `spd-infer generate`, each given as its `key=value` overrides and built by the
engine exactly as the CLI builds it, take turns on every prompt beside the suite's AR and transformers `generate`
(plain and with its prompt lookup), greedy and sampled, in one process on this machine.

Arms: `--arm "label: key=value ..."` (repeatable). `ar: method=ar` is always the first arm: every greedy arm is
checked token for token against it, and every sampled arm's draws against its keyed draws. `--hf generate,lookup`
adds transformers' rows (SDPA attention, its own products; `prompt_lookup_num_tokens=--hf-lookup-tokens`). Prompts
(--sets): the first --limit of each eval set (MT-Bench, GSM8K, HumanEval) and the first --everyday-limit held-out
everyday prompts, chat template, --max-new-tokens each, stopping at EOS; T = 0 and T = 1 (top-k 50, one seed per
prompt shared by every arm). On each prompt every arm of a temperature decodes before the next prompt, in an order
rotated one place per prompt, so every arm meets the same machine.

Each (temperature, prompt, arm) is appended to X.jsonl as it finishes and a run started again skips what is there (a
long run survives an interruption); X.json holds the summary: per set and temperature, tokens/s pooled over the
prompts, each arm against AR and against the fastest plain row, the geometric mean of its per-prompt ratios against
AR, τ (tokens after the first per target forward) for chains, each draft source's verified and accepted drafts, for
`suffix_branches=true` the share of cycles that ran branch rows and the rows a cycle, and the count of prompts equal
to AR; `per_source` the same per benchmark (MT-Bench, GSM8K, HumanEval, everyday), as the rows of a paper's Table 1.

    python -m bench.clock --arm "default: method=suffix W=4 datastore=answers+sharegpt" \\
        --arm "selfdraft: method=selfdraft" --hf generate,lookup --out docs/results/clock.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import zlib

import torch
from tqdm import tqdm

from bench.wallclock_sets import prompt_set
from bench.wallclock_turns import hf_run, seed_of
from spd.config import GenerateConfig, load_config
from spd.decoding import GenerationResult
from spd.engine import open_engine
from spd.eval.output import write_json
from spd.targets.row_costs import _cpu_name

AR_ARM = ("ar", "method=ar")
HF_LABELS = {"generate": "hf_generate", "lookup": "hf_prompt_lookup"}     # --hf
PLAIN = ("ar", "hf_generate")


def sampling_keys(temperature: float) -> list[str]:
    return ["temperature=0"] if temperature == 0 else [f"temperature={temperature:g}", "top_k=50", "top_p=1.0"]


def parse_arm(text: str) -> tuple[str, str]:
    label, sep, overrides = text.partition(":")
    if not sep or not label.strip():
        raise SystemExit(f"--arm {text!r}: write it as 'label: key=value ...'")
    return label.strip(), overrides.strip()


BRANCH_COUNTS = ("branch_cycles", "branch_rows")    # suffix_branches=true: cycles that ran branch rows, and the rows


def engine_run(engine, max_new_tokens: int):
    """run(key, ids) -> (result, extra) with this engine's decoder and sampling, seeded per prompt; extra: what the
    drafter's branch rows cost on this prompt, where it runs any."""
    def run(key, ids):
        before = [getattr(engine.drafter, name, 0) for name in BRANCH_COUNTS]
        result = engine.decoder.generate(ids, engine.request(max_new_tokens, seed=seed_of(key)))
        if not hasattr(engine.drafter, BRANCH_COUNTS[0]):
            return result, {}
        return result, {name: getattr(engine.drafter, name) - b for name, b in zip(BRANCH_COUNTS, before)}
    return run


def record(result: GenerationResult, extra: dict) -> dict:
    stats = result.stats
    row = {"tokens": len(result.token_ids), "seconds": result.seconds, "crc": hash_tokens(result.token_ids), **extra}
    if stats is not None and hasattr(stats, "cycles"):
        row.update(N=stats.N - 1, cycles=stats.cycles)     # τ: tokens after the prefill's per target forward
    elif stats is not None:
        row.update(N=stats.N, K=stats.K)
    if stats is not None and stats.sources:
        row["sources"] = {source: list(counts) for source, counts in stats.sources.items()}
    return row


def hash_tokens(ids: list[int]) -> int:
    """The tokens' checksum: equality with AR is read from the log without keeping every text."""
    return zlib.crc32(json.dumps(ids).encode())


def summarise(records: list[dict], arms: list[str], sets: dict[str, list[str]], temperatures: list[float]) -> list[dict]:
    """One row per (set, temperature, arm) over the prompts every arm of that temperature finished."""
    by = {(r["temperature"], r["key"], r["arm"]): r for r in records}
    rows = []
    for (set_name, keys), t in ((s, t) for s in sets.items() for t in temperatures):
        done = [k for k in keys if all((t, k, a) in by for a in arms)]
        if not done:
            continue
        cell = {}
        for arm in arms:
            rs = [by[(t, k, arm)] for k in done]
            tokens, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
            row = {"set": set_name, "temperature": t, "arm": arm, "prompts": len(done), "tokens": tokens,
                   "seconds": seconds, "tokens_per_s": tokens / seconds,
                   "equal_ar": sum(by[(t, k, arm)]["crc"] == by[(t, k, "ar")]["crc"] for k in done)}
            if all("cycles" in r for r in rs):
                cycles = max(1, sum(r["cycles"] for r in rs))
                row["tau"] = sum(r["N"] for r in rs) / cycles
                if all(BRANCH_COUNTS[0] in r for r in rs):
                    row["branch_cycle_share"] = sum(r["branch_cycles"] for r in rs) / cycles
                    row["branch_rows_per_cycle"] = sum(r["branch_rows"] for r in rs) / cycles
            if any("sources" in r for r in rs):     # draft source -> [verified, accepted], pooled
                pooled = {}
                for r in rs:
                    for source, (verified, accepted) in r.get("sources", {}).items():
                        counts = pooled.setdefault(source, [0, 0])
                        counts[0], counts[1] = counts[0] + verified, counts[1] + accepted
                row["sources"] = pooled
            per = [by[(t, k, arm)]["tokens"] / by[(t, k, arm)]["seconds"] /
                   (by[(t, k, "ar")]["tokens"] / by[(t, k, "ar")]["seconds"]) for k in done]
            row["vs_ar_geomean"] = math.exp(sum(map(math.log, per)) / len(per))
            cell[arm] = row
        fastest = max(cell[a]["tokens_per_s"] for a in cell if a in PLAIN)
        for row in cell.values():
            row["vs_ar"] = row["tokens_per_s"] / cell["ar"]["tokens_per_s"]
            row["vs_fastest_plain"] = row["tokens_per_s"] / fastest
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| set, T | arm | tokens/s | × AR (per-prompt geomean) | × fastest plain | τ | = AR |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if "tau" in r else ""
        lines.append(f"| {r['set']}, {r['temperature']:g} | {r['arm']} | {r['tokens_per_s']:.1f} | "
                     f"{r['vs_ar']:.2f}× ({r['vs_ar_geomean']:.2f}×) | {r['vs_fastest_plain']:.2f}× | {tau} | "
                     f"{r['equal_ar']}/{r['prompts']} |")
    return "\n".join(lines)


def decode(args, arms, hf, temperatures, records: list[dict], log: str) -> dict[str, list[str]]:
    """Every arm takes its turns on every prompt not yet in `log` (appended there and to `records`); returns each
    set's prompt keys."""
    done = {(r["temperature"], r["key"], r["arm"]) for r in records}
    with contextlib.ExitStack() as stack:
        runs = {}           # temperature -> [(label, run)]
        loaded = None
        for t in temperatures:
            runs[t] = []
            for label, overrides in arms:
                cfg = load_config(GenerateConfig, None, [f"target={args.target}", *overrides.split(),
                                                         *sampling_keys(t)])
                engine = stack.enter_context(open_engine(cfg))
                loaded = loaded or engine.session.loaded
                runs[t].append((label, engine_run(engine, args.max_new_tokens)))
            for h in hf:
                hf_decode = hf_run(loaded.model, loaded.tokenizer.pad_token_id or 0, t, args.max_new_tokens,
                                   args.hf_lookup_tokens if h == "lookup" else None)
                runs[t].append((HF_LABELS[h], lambda key, ids, hf_decode=hf_decode: (hf_decode(key, ids), {})))
        sets = {name: prompt_set(name, args, loaded.tokenizer) for name in args.sets.split(",")}
        # the sets' prompts alternate, each at every temperature, so a run cut short covers every cell alike
        prompts = [p for group in itertools.zip_longest(*sets.values()) for p in group if p is not None]
        for t in temperatures:          # warm-up: first calls load kernels and build caches
            for _, run in runs[t]:
                run("warm-up", prompts[0][1][:32])
        todo = [(t, i, key, ids) for i, (key, ids) in enumerate(prompts) for t in temperatures
                if any((t, key, label) not in done for label, _ in runs[t])]
        with open(log, "a") as out:
            for t, i, key, ids in tqdm(todo, desc="prompts", unit="prompt"):
                turn = runs[t][i % len(runs[t]):] + runs[t][: i % len(runs[t])]
                for label, run in turn:
                    if (t, key, label) in done:
                        continue
                    rec = {"temperature": t, "key": key, "arm": label, **record(*run(key, ids))}
                    records.append(rec)
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
    return {name: [k for k, _ in ps] for name, ps in sets.items()}


def logged_sets(records: list[dict]) -> dict[str, list[str]]:
    """--report: each set's prompt keys as the log holds them (the everyday set's keys start with "everyday/")."""
    sets: dict[str, list[str]] = {}
    for r in records:
        name = "everyday" if r["key"].startswith("everyday/") else "eval"
        if r["key"] not in sets.setdefault(name, []):
            sets[name].append(r["key"])
    return sets


def by_source(sets: dict[str, list[str]]) -> dict[str, list[str]]:
    """The sets split by where each prompt comes from (the key's prefix: mt_bench, gsm8k, humaneval, everyday): the
    per-benchmark rows of the paper's Table 1."""
    out: dict[str, list[str]] = {}
    for keys in sets.values():
        for key in keys:
            out.setdefault(key.split("/")[0], []).append(key)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", default=[], help="'label: key=value ...' (repeatable)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--hf", default="", help="transformers rows: generate and/or lookup (comma-separated)")
    ap.add_argument("--hf-lookup-tokens", type=int, default=8)
    ap.add_argument("--sets", default="eval,everyday")
    ap.add_argument("--limit", type=int, default=10, help="first prompts of each eval set")
    ap.add_argument("--everyday-limit", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--out", default="docs/results/clock.json")
    ap.add_argument("--report", action="store_true", help="decode nothing: the summary of what X.jsonl holds")
    args = ap.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    arms = [AR_ARM] + [parse_arm(a) for a in args.arm if parse_arm(a)[0] != "ar"]
    if len({label for label, _ in arms}) != len(arms):
        raise SystemExit("--arm: two arms share a label; give each its own")
    hf = [h for h in args.hf.split(",") if h]
    if set(hf) - set(HF_LABELS):
        raise SystemExit(f"--hf {args.hf!r}: use generate and/or lookup")
    labels = [label for label, _ in arms] + [HF_LABELS[h] for h in hf]

    log = os.path.splitext(args.out)[0] + ".jsonl"
    records = []
    if os.path.exists(log):
        with open(log) as f:
            records = [json.loads(line) for line in f if line.strip()]

    keys = logged_sets(records) if args.report else decode(args, arms, hf, temperatures, records, log)
    rows = summarise(records, labels, keys, temperatures)
    per_source = summarise(records, labels, by_source(keys), temperatures)
    write_json(args.out, {"machine": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "python": platform.python_version(),
                          "target": args.target, "max_new_tokens": args.max_new_tokens,
                          "arms": dict(arms), "hf_lookup_tokens": args.hf_lookup_tokens, "rows": rows,
                          "per_source": per_source})
    print(table(rows))
    print("\nper source of prompts:\n" + table(per_source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
