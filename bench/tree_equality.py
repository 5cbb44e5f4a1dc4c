"""Greedy draft trees are lossless on the real target: for every eval prompt (80 per data set, 240 in all), one
configured decoder (any `spd-infer generate` keys, e.g. `method=eagle3 W=4`) decodes greedily step by step, and its
tokens must equal the target's own greedy decode, read from the recorded greedy traces (bench/fast_eval_check.py's
protocol: 16 new tokens). A difference is acceptable only where the target's top-2 logit margin at the first
differing token is below 1e-4 (float ties); every difference is listed with that margin.

    python -m bench.tree_equality --label spd_w4 method=spd W=4
    python -m bench.tree_equality --label ppsd_w4 method=ppsd W=4 checkpoint=outputs/grid/ppsd_n5/checkpoint
    python -m bench.tree_equality --label eagle3_w4 method=eagle3 W=4 tree_nodes=16 \
        checkpoint=outputs/grid/eagle3/checkpoint

The traces are the 512-token greedy recordings of `spd-infer eval` (--trace-dir; any recording of >= 16 tokens
serves: greedy decoding's first 16 tokens are a prefix of its first 512), which are float32's; with --live-reference
the target's own greedy decode (AR, with each position's top-2 margin) runs here, in the configuration's dtype:

    python -m bench.tree_equality --label default_bf16 --live-reference --out docs/results/tree_equality_bf16.json \
        method=suffix W=4 datastore=answers+sharegpt dtype=bfloat16

With --reference 'weights=float32' the reference is the same configuration with those keys on top, decoded here with
the same request (for a decoder whose sampled draws are its own: SPD's and EAGLE-3's rejection sampling). With
--temperature 1 (and --live-reference) every prompt is decoded with keyed draws at T = 1 (top-k 50, one seed a
prompt) by AR and by the configuration: lossless sampling draws AR's very tokens, so every difference counts.

Resumable: finished (label, prompt) rows are kept in <out>l and skipped. Writes one entry per label into --out (default docs/results/tree_equality.json).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import time
import zlib

import torch
from tqdm import tqdm

from spd.config import GenerateConfig, load_config
from spd.decoding import Request
from spd.engine import open_engine
from spd.verify.sampling import SamplingParams

from bench.fast_eval_check import MARGIN, eval_prompts, finished_rows   # this folder: the fast evaluator check's helpers


def trace_file(trace_dir: str, dataset: str, qid) -> str:
    (path,) = glob.glob(os.path.join(trace_dir, f"{dataset}-{qid}.pt"))
    return path


def live_trace(engine, ids: list[int], request: Request) -> dict:
    """The target's own decode of `ids` in the engine's dtype (greedy, or the request's keyed draws), with the top-2
    logit margin of every position."""
    from spd.runtime.ar import ARDecoder
    from spd.verify.sampling import top2_margin

    margins = []
    ar = ARDecoder(engine.session.staged, engine.session.eos_ids, observe=lambda logits, _: margins.append(
        top2_margin(logits)))
    out = ar.generate(list(ids), request)
    return {"prompt_ids": list(ids), "tokens": out.token_ids, "margins": margins}


def request_for(args, ds: str, qid) -> Request:
    """Greedy, or at --temperature (top-k 50) with one seed per prompt: the keyed draws AR and the decoder share."""
    if not args.temperature:
        return Request(args.max_new_tokens, SamplingParams(), 0)
    return Request(args.max_new_tokens, SamplingParams(args.temperature, top_k=50), zlib.crc32(f"{ds}/{qid}".encode()))


def row_for(label, ds, qid, tokens, stats, trace, max_new_tokens, seconds) -> dict:
    expected = trace["tokens"][:max_new_tokens]
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                 None if len(tokens) == len(expected) else min(len(tokens), len(expected)))
    return {"label": label, "dataset": ds, "question_id": qid, "tokens": len(tokens), "equal": first is None,
            "first_difference": first,
            "target_margin": None if first is None or first >= len(trace["margins"]) else trace["margins"][first],
            "N": stats.N, "seconds": seconds,     # a pipeline's steps, rollbacks and restarts; a chain's cycles
            **{key: getattr(stats, key, None) for key in ("K", "rollbacks", "restarts", "cycles", "accepted")}}


def summarise(rows: list[dict], label: str, overrides: list[str]) -> dict:
    mine = [r for r in rows if r["label"] == label]
    differences = [r for r in mine if not r["equal"]]
    unexplained = [r for r in differences if r["target_margin"] is None or r["target_margin"] >= MARGIN]
    per_dataset = {}
    for r in mine:
        entry = per_dataset.setdefault(r["dataset"], {"prompts": 0, "equal": 0})
        entry["prompts"] += 1
        entry["equal"] += r["equal"]
    return {"overrides": overrides, "prompts": len(mine), "equal": len(mine) - len(differences),
            "tokens": sum(r["tokens"] for r in mine), "seconds": round(sum(r["seconds"] for r in mine), 1),
            **{key: sum(r.get(key) or 0 for r in mine) for key in ("rollbacks", "restarts", "cycles", "accepted")},
            "per_dataset": per_dataset, "differences": differences, "unexplained_differences": len(unexplained)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True, help="this configuration's name in the output")
    ap.add_argument("--limit", type=int, default=80, help="prompts per data set")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--trace-dir", default=None, help="a greedy trace directory (default: the one under "
                                                      "outputs/cache/traces with the most recordings)")
    ap.add_argument("--live-reference", action="store_true", help="decode the reference (AR) here, in the "
                    "configuration's dtype, instead of reading the float32 traces")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: keyed draws at this temperature (top-k "
                    "50, one seed per prompt) against AR's own, decoded here (needs --live-reference)")
    ap.add_argument("--reference", default=None, help="'key=value ...': the reference is this configuration's own "
                    "decode (the overrides with these on top, e.g. 'weights=float32'), decoded here, instead of AR's: "
                    "for decoders whose sampled draws are their own (rejection sampling), the same seed")
    ap.add_argument("--out", default="docs/results/tree_equality.json")
    ap.add_argument("overrides", nargs="*", help="spd-infer generate keys: method=eagle3 W=4 ...")
    args = ap.parse_args()
    recorded = glob.glob("outputs/cache/traces/greedy-*")
    if not (args.live_reference or args.reference or args.trace_dir or recorded):
        raise SystemExit("no greedy traces under outputs/cache/traces: record them with spd-infer eval --trace-dir, "
                         "give --trace-dir, or decode the reference here with --live-reference")
    if args.temperature and not (args.live_reference or args.reference):
        raise SystemExit("--temperature compares against draws decoded here: add --live-reference or --reference")
    args.live_reference = args.live_reference or bool(args.reference)
    trace_dir = None if args.live_reference else args.trace_dir or max(recorded, key=lambda d: len(os.listdir(d)))
    sampled = [f"temperature={args.temperature:g}", "top_k=50"] if args.temperature else []
    cfg = load_config(GenerateConfig, None, [*args.overrides, *sampled, f"max_new_tokens={args.max_new_tokens}"])
    rows_path = args.out + "l"
    done = finished_rows(rows_path, "label")
    reference = None if args.reference is None else load_config(
        GenerateConfig, None, [*args.overrides, *args.reference.split(), *sampled,
                               f"max_new_tokens={args.max_new_tokens}"])
    with open_engine(cfg) as engine, open(rows_path, "a") as sink, \
            (open_engine(reference) if reference is not None else contextlib.nullcontext(None)) as other:
        prompts = eval_prompts(engine.session.loaded.tokenizer, args.limit)
        for ds, qid, ids in tqdm(prompts, desc=args.label, mininterval=30):
            if (args.label, ds, str(qid)) in done:
                continue
            request = request_for(args, ds, qid)
            if other is not None:       # the other configuration's own decode of the same request
                trace = {"prompt_ids": list(ids), "tokens": other.decoder.generate(list(ids), request).token_ids,
                         "margins": []}
            else:
                trace = live_trace(engine, ids, request) if args.live_reference else \
                    torch.load(trace_file(trace_dir, ds, qid))
            assert trace["prompt_ids"] == list(ids), f"{ds}-{qid}: the trace was recorded for another prompt"
            if args.temperature:    # a sampled difference is never a float tie
                trace["margins"] = []
            start = time.perf_counter()
            out = engine.decoder.generate(list(ids), request)
            row = row_for(args.label, ds, qid, out.token_ids, out.stats, trace, args.max_new_tokens,
                          time.perf_counter() - start)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            done[(args.label, ds, str(qid))] = row
    result = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    result[args.label] = summarise(list(done.values()), args.label, args.overrides)
    result[args.label]["trace_dir"] = f"live: {args.reference}" if args.reference else "live AR" \
        if args.live_reference else os.path.basename(trace_dir)
    result[args.label]["temperature"] = args.temperature
    with open(args.out + ".tmp", "w") as fh:
        json.dump(result, fh, indent=2)
    os.replace(args.out + ".tmp", args.out)
    summary = {k: v for k, v in result[args.label].items() if k != "differences"}
    print(json.dumps(summary, indent=1))
    return 0 if not result[args.label]["unexplained_differences"] else 1


if __name__ == "__main__":
    sys.exit(main())
