"""By the clock, the suite's one timing driver: configurations of `spd-infer generate`, each given as its `key=value`
overrides and built by the engine exactly as the CLI builds it, take turns on every prompt beside the suite's AR and
transformers `generate` (plain and with its prompt lookup), greedy and sampled, in one process on this machine.

Arms: `--arm "label: key=value ..."` (repeatable; leading `NAME=value` words in capitals are environment variables
for that arm's build, e.g. `SPD_PANEL_LEVEL=avx2`; `BENCH_NATIVE_KERNEL=REV:ARCH` decodes through an older kernel
build, bench/native_build.py): any method, W, datastore, dtype, runtime (`runtime=distributed
n=2 controller=first_stage` runs its stage processes; each arm decodes with the threads its engine set). `ar:
method=ar` is always the first arm: every greedy arm is checked token for token against it, and every sampled arm's
draws against its keyed draws. `--hf generate,lookup` adds transformers' rows (SDPA attention, its own products;
`prompt_lookup_num_tokens=--hf-lookup-tokens`). `--batch 1,4,8`: every arm that decodes many requests together
(its engine's batch decoder) also takes each set's prompts submitted at once at each max_batch, tokens/s over the
whole batch's time. Prompts (--sets): the first --limit of each eval set (MT-Bench, GSM8K, HumanEval) and the first
--everyday-limit held-out everyday prompts, chat template, --max-new-tokens each, stopping at EOS; T = 0 and T = 1
(top-k 50, one seed per prompt shared by every arm). On each prompt every arm of a temperature decodes before the
next prompt, in an order rotated one place per prompt, so every arm meets the same machine.

Each (temperature, prompt, arm) is appended to X.jsonl as it finishes and a run started again skips what is there (a
long run survives an interruption); X.json holds the summary: per set and temperature, tokens/s pooled over the
prompts (the call to the last token) and the decode rate (tokens after the first over the first token to the last,
every arm alike), each arm against AR and against the fastest plain row, the geometric mean of its per-prompt ratios against
AR and its worst prompt, τ (tokens after the first per target forward) and rows a cycle for chains, α (tokens a step)
for pipelines, each draft source's verified and accepted drafts, the share of cycles a priced drafter left plain,
for `suffix_branches=true` the share of cycles that ran branch rows and the rows a cycle, the count of prompts equal
to AR, and the share of AR's greedy positions inside a repeated 32-token span; `per_source` the same per benchmark
(MT-Bench, GSM8K, HumanEval, everyday), as the rows of a paper's Table 1.

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
import sys
import time
import zlib
from unittest import mock

import torch
from tqdm import tqdm

from bench.llama_cpp import llama_run
from bench.native_build import ENV as NATIVE_ENV, through_native
from bench.prompt_sets import REPEAT_SPAN, prompt_set, repeating
from bench.turns import hf_run, rotated, seed_of
from spd.config import GenerateConfig, load_config
from spd.decoding import GenerationResult
from spd.engine import open_engine
from spd.eval.output import write_json
from spd.targets.row_costs import _cpu_name

AR_ARM = ("ar", "method=ar")
HF_LABELS = {"generate": "hf_generate", "lookup": "hf_prompt_lookup"}     # --hf
LLAMA_LABELS = {"plain": "llama_cpp", "lookup": "llama_cpp_lookup"}       # --llama
PLAIN = ("ar", "hf_generate", "llama_cpp")


def sampling_keys(temperature: float) -> list[str]:
    return ["temperature=0"] if temperature == 0 else [f"temperature={temperature:g}", "top_k=50", "top_p=1.0"]


def parse_arm(text: str) -> tuple[str, str]:
    label, sep, overrides = text.partition(":")
    if not sep or not label.strip():
        raise SystemExit(f"--arm {text!r}: write it as 'label: key=value ...'")
    return label.strip(), overrides.strip()


BRANCH_COUNTS = ("branch_cycles", "branch_rows")    # suffix_branches=true: cycles that ran branch rows, and the rows
# a drafter's tallies read around each prompt, by their name in a record: branch rows (suffix_branches=true), and a
# priced drafter's cycles and those its pricing left plain AR steps
COUNTED = {"branch_cycles": "branch_cycles", "branch_rows": "branch_rows", "cycles": "drafter_cycles",
           "priced_out": "priced_out"}


def engine_run(engine, max_new_tokens: int, threads: int):
    """run(key, ids) -> (result, extra) with this engine's decoder and sampling, seeded per prompt, on the threads its
    engine set (a distributed arm's controller sets its own); extra: what the drafter's branch rows and pricing did on
    this prompt, where it has any."""
    counted = [name for name in COUNTED if hasattr(engine.drafter, name)]

    def run(key, ids):
        torch.set_num_threads(threads)
        before = [getattr(engine.drafter, name) for name in counted]
        result = engine.decoder.generate(ids, engine.request(max_new_tokens, seed=seed_of(key)))
        return result, {COUNTED[name]: getattr(engine.drafter, name) - b for name, b in zip(counted, before)}
    return run


def record(result: GenerationResult, extra: dict) -> dict:
    stats = result.stats
    row = {"tokens": len(result.token_ids), "seconds": result.seconds, "first_seconds": result.first_seconds,
           "crc": hash_tokens(result.token_ids), **extra}
    if stats is not None and hasattr(stats, "cycles"):
        # τ: tokens after the prefill's per target forward; rows a cycle: 1 + drafted / cycles
        row.update(N=stats.N - 1, cycles=stats.cycles, drafted=stats.drafted)
    elif stats is not None:
        row.update(N=stats.N, K=stats.K)
    if stats is not None and stats.sources:
        row["sources"] = {source: list(counts) for source, counts in stats.sources.items()}
    return row


def hash_tokens(ids: list[int]) -> int:
    """The tokens' checksum: equality with AR is read from the log without keeping every text."""
    return zlib.crc32(json.dumps(ids).encode())


def pooled(rs: list[dict], name: str) -> float:
    return sum(r[name] for r in rs)


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
            tokens, seconds = pooled(rs, "tokens"), pooled(rs, "seconds")
            row = {"set": set_name, "temperature": t, "arm": arm, "prompts": len(done), "tokens": tokens,
                   "seconds": seconds, "tokens_per_s": tokens / seconds,
                   "equal_ar": sum(by[(t, k, arm)]["crc"] == by[(t, k, "ar")]["crc"] for k in done)}
            if all(r.get("first_seconds") is not None for r in rs):
                # the decode rate: tokens after the first over the first token to the last, every arm alike
                row["decode_tokens_per_s"] = (tokens - len(rs)) / (seconds - pooled(rs, "first_seconds"))
            if all("cycles" in r for r in rs):
                cycles = max(1, pooled(rs, "cycles"))
                row["tau"] = pooled(rs, "N") / cycles
                if all("drafted" in r for r in rs):
                    row["rows_per_cycle"] = 1 + pooled(rs, "drafted") / cycles
                if all(BRANCH_COUNTS[0] in r for r in rs):
                    row["branch_cycle_share"] = pooled(rs, "branch_cycles") / cycles
                    row["branch_rows_per_cycle"] = pooled(rs, "branch_rows") / cycles
            elif all("K" in r for r in rs):         # a pipeline: tokens per step
                row["alpha"] = pooled(rs, "N") / max(1, pooled(rs, "K"))
            if all("priced_out" in r for r in rs):
                row["priced_out_share"] = pooled(rs, "priced_out") / max(1, pooled(rs, "drafter_cycles"))
            if any("sources" in r for r in rs):     # draft source -> [verified, accepted], pooled
                counts: dict[str, list[int]] = {}
                for r in rs:
                    for source, (verified, accepted) in r.get("sources", {}).items():
                        total = counts.setdefault(source, [0, 0])
                        total[0], total[1] = total[0] + verified, total[1] + accepted
                row["sources"] = counts
            per = {k: by[(t, k, arm)]["tokens"] / by[(t, k, arm)]["seconds"] /
                   (by[(t, k, "ar")]["tokens"] / by[(t, k, "ar")]["seconds"]) for k in done}
            row["vs_ar_geomean"] = math.exp(sum(map(math.log, per.values())) / len(per))
            row["worst_prompt"] = min(per, key=per.get)
            row["worst_prompt_vs_ar"] = per[row["worst_prompt"]]
            row["prompts_under_ar"] = sum(ratio < 1 for ratio in per.values())
            if arm == "ar" and all("repeats" in r for r in rs):
                # how much of AR's greedy text repeats itself: what a context drafter can find
                row["repeat_share"] = pooled(rs, "repeats") / max(1, tokens)
            cell[arm] = row
        fastest = max(cell[a]["tokens_per_s"] for a in cell if a in PLAIN)
        for row in cell.values():
            row["vs_ar"] = row["tokens_per_s"] / cell["ar"]["tokens_per_s"]
            row["vs_fastest_plain"] = row["tokens_per_s"] / fastest
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| set, T | arm | tokens/s | decode tokens/s | × AR (per-prompt geomean) | × fastest plain | τ (α) | "
             "rows a cycle | worst prompt × AR | = AR |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if "tau" in r else f"({r['alpha']:.2f})" if "alpha" in r else ""
        per_cycle = f"{r['rows_per_cycle']:.2f}" if "rows_per_cycle" in r else ""
        decode = f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else ""
        lines.append(f"| {r['set']}, {r['temperature']:g} | {r['arm']} | {r['tokens_per_s']:.1f} | {decode} | "
                     f"{r['vs_ar']:.2f}× ({r['vs_ar_geomean']:.2f}×) | {r['vs_fastest_plain']:.2f}× | {tau} | "
                     f"{per_cycle} | {r['worst_prompt_vs_ar']:.2f}× | {r['equal_ar']}/{r['prompts']} |")
    return "\n".join(lines)


def batched(engines, sets, temperatures, sizes: list[int], max_new_tokens: int, records: list[dict]) -> list[dict]:
    """Each set's prompts submitted at once to every arm's batch decoder (an engine without one is left out), at each
    max_batch: tokens/s over the whole batch's time, and (greedy) the answers equal to AR's alone."""
    ar = {(r["temperature"], r["key"]): r["crc"] for r in records if r["arm"] == "ar"}
    rows = []
    for size, t, (set_name, prompts) in itertools.product(sizes, temperatures, sets.items()):
        for label, engine, threads in engines[t]:
            decoder = engine.batch_decoder(size)
            if decoder is None:
                continue
            torch.set_num_threads(threads)
            start = time.perf_counter()
            tickets = {key: decoder.submit(ids, engine.request(max_new_tokens, seed=seed_of(key)))
                       for key, ids in prompts}
            decoder.run()
            seconds = time.perf_counter() - start
            tokens = sum(len(ticket.tokens) for ticket in tickets.values())
            rows.append({"set": set_name, "temperature": t, "arm": label, "max_batch": size, "prompts": len(prompts),
                         "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "equal_ar": sum(hash_tokens(ticket.tokens) == ar.get((t, key))
                                         for key, ticket in tickets.items())})
            print(f"batched {label} max_batch={size} {set_name} T={t:g}: {tokens / seconds:.1f} tokens/s",
                  file=sys.stderr)
    return rows


def arm_environment(overrides: str) -> tuple[dict[str, str], list[str]]:
    """An arm's leading NAME=value words in capitals are environment variables for its build, as in a shell
    (`"avx2: SPD_PANEL_LEVEL=avx2 method=ar"`); the rest are its keys."""
    words, env = overrides.split(), {}
    while words and words[0].partition("=")[0].isupper() and "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def environment(env: dict[str, str]):
    """os.environ with `env` set while the context is open, as it was afterwards."""
    return mock.patch.dict(os.environ, env)


def decode(args, arms, hf, llama, temperatures, records: list[dict],
           log: str) -> tuple[dict[str, list[str]], list[dict]]:
    """Every arm takes its turns on every prompt not yet in `log` (appended there and to `records`), then with
    --batch the batched rows; returns each set's prompt keys and the batched rows."""
    done = {(r["temperature"], r["key"], r["arm"]) for r in records}
    with contextlib.ExitStack() as stack:
        runs = {}           # temperature -> [(label, run)]
        engines = {}        # temperature -> [(label, engine, the threads it set)]
        loaded = None
        for t in temperatures:
            runs[t], engines[t] = [], []
            for label, overrides in arms:
                env, keys = arm_environment(overrides)
                native = env.pop(NATIVE_ENV, None)      # not the engine's: the bench swaps the kernel per call
                cfg = load_config(GenerateConfig, None, [f"target={args.target}", *keys, *sampling_keys(t)])
                with environment(env):          # read while the engine builds its target (SPD_PANEL_LEVEL=avx2)
                    engine = stack.enter_context(open_engine(cfg))
                loaded = loaded or engine.session.loaded
                threads = torch.get_num_threads()      # what the engine set (a distributed arm's controller: its own)
                engines[t].append((label, engine, threads))
                run = engine_run(engine, args.max_new_tokens, threads)
                runs[t].append((label, through_native(run, native) if native else run))
            for h in hf:
                hf_decode = hf_run(loaded.model, loaded.tokenizer.pad_token_id or 0, t, args.max_new_tokens,
                                   args.hf_lookup_tokens if h == "lookup" else None)
                runs[t].append((HF_LABELS[h], lambda key, ids, hf_decode=hf_decode: (hf_decode(key, ids), {})))
            for kind in llama:      # at AR's thread count (the first arm's)
                llama_decode = llama_run(args.target, kind, engines[t][0][2], t, args.max_new_tokens,
                                         set(engines[t][0][1].session.eos_ids), seed_of)
                runs[t].append((LLAMA_LABELS[kind],
                                lambda key, ids, llama_decode=llama_decode: (llama_decode(key, ids), {})))
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
                for label, run in rotated(runs[t], i):
                    if (t, key, label) in done:
                        continue
                    result, extra = run(key, ids)
                    rec = {"temperature": t, "key": key, "arm": label, **record(result, extra)}
                    if label == "ar" and t == 0:
                        rec["repeats"] = len(repeating(ids + result.token_ids, len(ids), REPEAT_SPAN))
                    records.append(rec)
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
        rows = batched(engines, sets, temperatures, args.batch, args.max_new_tokens, records) if args.batch else []
    return {name: [k for k, _ in ps] for name, ps in sets.items()}, rows


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
    ap.add_argument("--llama", default="", help="llama.cpp rows on the same GGUF: plain and/or lookup (its prompt "
                    "lookup speculation); needs the peers extra")
    ap.add_argument("--sets", default="eval,everyday")
    ap.add_argument("--limit", type=int, default=10, help="first prompts of each eval set")
    ap.add_argument("--everyday-limit", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--out", default="docs/results/clock.json")
    ap.add_argument("--batch", default="", help="e.g. 1,4,8: also every arm's batch decoder at these max_batch, "
                    "each set's prompts submitted at once")
    ap.add_argument("--report", action="store_true", help="decode nothing: the summary of what X.jsonl holds")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",") if b]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    arms = [AR_ARM] + [parse_arm(a) for a in args.arm if parse_arm(a)[0] != "ar"]
    if len({label for label, _ in arms}) != len(arms):
        raise SystemExit("--arm: two arms share a label; give each its own")
    hf = [h for h in args.hf.split(",") if h]
    if set(hf) - set(HF_LABELS):
        raise SystemExit(f"--hf {args.hf!r}: use generate and/or lookup")
    llama = [k for k in args.llama.split(",") if k]
    if set(llama) - set(LLAMA_LABELS):
        raise SystemExit(f"--llama {args.llama!r}: use plain and/or lookup")
    labels = [label for label, _ in arms] + [HF_LABELS[h] for h in hf] + [LLAMA_LABELS[k] for k in llama]

    log = os.path.splitext(args.out)[0] + ".jsonl"
    records = []
    if os.path.exists(log):
        with open(log) as f:
            records = [json.loads(line) for line in f if line.strip()]

    keys, batch_rows = (logged_sets(records), []) if args.report else decode(args, arms, hf, llama, temperatures,
                                                                            records, log)
    rows = summarise(records, labels, keys, temperatures)
    per_source = summarise(records, labels, by_source(keys), temperatures)
    write_json(args.out, {"machine": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "python": platform.python_version(),
                          "target": args.target, "max_new_tokens": args.max_new_tokens,
                          "arms": dict(arms), "hf_lookup_tokens": args.hf_lookup_tokens, "rows": rows,
                          "per_source": per_source, **({"batched": batch_rows} if batch_rows else {})})
    print(table(rows))
    print("\nper source of prompts:\n" + table(per_source))
    for r in batch_rows:
        print(f"batched {r['arm']} max_batch={r['max_batch']} {r['set']} T={r['temperature']:g}: "
              f"{r['tokens_per_s']:.1f} tokens/s, {r['equal_ar']}/{r['prompts']} = AR")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
