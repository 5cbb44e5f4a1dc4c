"""Where does acceptance come from: new text, or output that repeats itself? Greedy, from the target's own traces
(the eval's trace cache: `spd-infer eval` with the same config records and reuses them).

For the first --limit prompts of each eval set: L′acc of the module alone and of lookup+module (spd.eval.fast, the
exact replay of the runtime), and how much of it falls inside a repeat — a generated position whose last --span
tokens (itself included) already occurred earlier in the context, i.e. the answer is copying a whole span of
itself or of the prompt (a loop until the length limit is the extreme case).

    python -m experiments.repetition --limit 10 --out docs/results/repetition.json

With --temperature > 0 there is no trace to replay: each configuration decodes every prompt step by step (the
sampled eval config: top-k, top-p, one seed per prompt), and acceptance is placed by the decode's own verdicts
inside that decode's output.

    python -m experiments.repetition --temperature 1 --limit 4 --out docs/results/repetition_t1.json

The figure's page: docs/evaluation.md, "Acceptance with the context lookup, and how much of it is repetition".
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from spd.config import load_config
from spd.engine import open_engine
from spd.eval.config import EvalConfig
from spd.eval.harness import prompt_seed
from spd.eval.output import write_json
from spd.eval.traces import TraceCache
from spd.eval.fast_trace import fast_greedy_stats
from spd.eval.fast_chain import fast_lookup_stats
from spd.methods import METHODS
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.session import open_session

from bench.prompt_sets import repeating

SOURCES = ("module", "lookup+module")                  # SPD's pipelined drafts, n = the module's
CHAIN = "lookup chain"                                  # method=lookup, the default's settings
RUNS = {"module": ["draft_source=module"], "lookup+module": ["draft_source=lookup+module"], CHAIN: ["method=lookup"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="default: configs/eval/greedy.yaml, or sampled.yaml at T > 0")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--span", type=int, default=32)
    ap.add_argument("--out", default="docs/results/repetition.json")
    ap.add_argument("overrides", nargs="*", help="eval config overrides (key=value)")
    args = ap.parse_args()
    if args.temperature > 0:
        return sampled(args)
    cfg = load_config(EvalConfig, args.config or "configs/eval/greedy.yaml", args.overrides)
    session = open_session(cfg)
    traces = TraceCache(cfg.trace_cache_dir, session.loaded, session.staged, cfg.max_new_tokens)
    blank = {"prompts": 0, "positions": 0, "positions_in_repeats": 0}
    per = {ds: {**blank, **{s: {"N": 0, "K": 0, "cycles": 0, "accepted": 0, "accepted_in_repeats": 0, "sources": {}}
                            for s in (*SOURCES, CHAIN)}} for ds in DATASETS}
    m = METHODS["lookup"].draft_length
    work = [(ds, q) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    for ds, q in tqdm(work, desc="traces", unit="prompt"):
        ids = chat_prompt_ids(session.loaded.tokenizer, q["turns"][0])
        trace, _ = traces.get(ds, q["question_id"], ids)
        inside = repeating(trace.prompt_ids + trace.tokens, len(ids), args.span)
        row = per[ds]
        row["prompts"] += 1
        row["positions"] += len(trace.tokens)
        row["positions_in_repeats"] += len(inside)
        for name in SOURCES:
            lookup = (session.spec.lookup.min_ngram, session.spec.lookup.max_ngram) if name == "lookup+module" else None
            stats = fast_greedy_stats(session.module, trace, lookup, counter(row[name], inside, 0))["stats"]
            row[name]["N"] += stats.N
            row[name]["K"] += stats.K
        stats = fast_lookup_stats(trace, session.spec.lookup.min_ngram, session.spec.lookup.max_ngram, m, counter(row[CHAIN], inside, len(ids)))["stats"]
        row[CHAIN]["N"] += stats.N - 1                      # τ counts the tokens after the prefill's
        row[CHAIN]["cycles"] += stats.cycles
    n = session.staged.n
    for row in per.values():
        row["repeat_share"] = row["positions_in_repeats"] / row["positions"]
        row[CHAIN]["tau"] = row[CHAIN]["N"] / row[CHAIN]["cycles"]
        for name in (*SOURCES, CHAIN):
            f = row[name]
            if name in SOURCES:
                f["eal"] = n * f["N"] / f["K"]
            f["accepted_in_repeats_share"] = f["accepted_in_repeats"] / f["accepted"] if f["accepted"] else None
            f["acceptance"] = {s: a / v for s, (v, a) in f["sources"].items()}
    report = {"per_dataset": per, "n": n, "checkpoint": session.spec.module.checkpoint, "span": args.span, "limit": args.limit,
              "lookup_chain": {"draft_length": m, "ngrams": [session.spec.lookup.min_ngram, session.spec.lookup.max_ngram]},
              "max_new_tokens": cfg.max_new_tokens, "command": " ".join(["python", *sys.argv])}
    write_json(args.out, report)
    print(markdown(report))
    return 0


def sampled(args) -> int:
    """Each configuration decodes the prompts itself; its verdicts say where its accepted drafts sit."""
    per = {ds: {name: {"prompts": 0, "positions": 0, "positions_in_repeats": 0, "N": 0, "K": 0, "cycles": 0,
                       "accepted": 0, "accepted_in_repeats": 0, "sources": {}} for name in RUNS} for ds in DATASETS}
    work = [(ds, q) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    meta = {}
    for name, keys in RUNS.items():
        cfg = load_config(EvalConfig, args.config or "configs/eval/sampled.yaml",
                          [*keys, f"temperature={args.temperature}", *args.overrides])
        with open_engine(cfg) as engine:
            tok = engine.session.loaded.tokenizer
            meta[name] = {"n": engine.session.staged.n, "checkpoint": engine.session.spec.module.checkpoint,
                          "runtime": cfg.runtime, "top_k": cfg.top_k, "top_p": cfg.top_p}
            for ds, q in tqdm(work, desc=name, unit="prompt"):
                ids = chat_prompt_ids(tok, q["turns"][0])
                request = engine.request(seed=prompt_seed(cfg.seed, ds, q["question_id"]))
                result = engine.decoder.generate(ids, request)
                inside = repeating(ids + result.token_ids, len(ids), args.span)
                f, stats = per[ds][name], result.stats
                f["prompts"] += 1
                f["positions"] += len(result.token_ids)
                f["positions_in_repeats"] += len(inside)
                settled = counter(f, inside, len(ids))
                for index, source, accepted in stats.verdicts:
                    settled(index, accepted, source)
                if name == CHAIN:
                    f["N"] += stats.N - 1
                    f["cycles"] += stats.cycles
                else:
                    f["N"] += stats.N
                    f["K"] += stats.K
    for row in per.values():
        for name, f in row.items():
            f["repeat_share"] = f["positions_in_repeats"] / f["positions"]
            if name == CHAIN:
                f["tau"] = f["N"] / f["cycles"]
            else:
                f["eal"] = meta[name]["n"] * f["N"] / f["K"]
            f["accepted_in_repeats_share"] = f["accepted_in_repeats"] / f["accepted"] if f["accepted"] else None
            f["acceptance"] = {s: a / v for s, (v, a) in f["sources"].items()}
    report = {"per_dataset": per, "runs": meta, "temperature": args.temperature, "span": args.span,
              "limit": args.limit, "command": " ".join(["python", *sys.argv])}
    write_json(args.out, report)
    print(markdown_sampled(report))
    return 0


def markdown_sampled(report: dict) -> str:
    lines = [f"| data set | configuration | positions inside a repeat (≥ {report['span']} tokens) | L′acc or τ | "
             "acceptance per source | accepted drafts inside repeats |", "|---|---|---:|---:|---|---:|"]
    for ds, row in report["per_dataset"].items():
        for name, f in row.items():
            figure = f"τ {f['tau']:.3f}" if name == CHAIN else f"{f['eal']:.3f}"
            acc = ", ".join(f"{s} {a:.2f}" for s, a in sorted(f["acceptance"].items()))
            lines.append(f"| {ds} | {name} | {f['repeat_share']:.1%} | {figure} | {acc} | "
                         f"{f['accepted_in_repeats_share'] or 0:.1%} |")
    return "\n".join(lines)


def counter(figures: dict, inside: set[int], offset: int):
    """on_settle for the fast evaluators: tallies verified and accepted drafts, per source and inside repeats.
    offset: added to the position reported (the chain reports indices into the generated tokens)."""
    def settled(pos, accepted, source):
        figures["accepted"] += accepted
        figures["accepted_in_repeats"] += accepted and (pos + offset) in inside
        counts = figures["sources"].setdefault(source, [0, 0])
        counts[0] += 1
        counts[1] += accepted
    return settled


def markdown(report: dict) -> str:
    lines = [f"| data set | positions inside a repeat (≥ {report['span']} tokens) | L′acc module | L′acc lookup+module | "
             "acceptance lookup / module | lookup chain τ (acceptance) | accepted drafts inside repeats (module, "
             "lookup+module, lookup chain) |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for ds, row in report["per_dataset"].items():
        hybrid, module, chain = row["lookup+module"], row["module"], row[CHAIN]
        acc = hybrid["acceptance"]
        share = [f"{f['accepted_in_repeats_share'] or 0:.1%}" for f in (module, hybrid, chain)]
        lines.append(f"| {ds} | {row['repeat_share']:.1%} | {module['eal']:.3f} | {hybrid['eal']:.3f} | "
                     f"{acc.get('lookup', 0):.2f} / {acc.get('module', 0):.2f} | "
                     f"{chain['tau']:.2f} ({chain['acceptance'].get('lookup', 0):.2f}) | {', '.join(share)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
