"""Decoding speed against the hardware limit: tokens/s of HF `generate` (dynamic cache; static cache +
`torch.compile`), this suite's AR (eager; fixed-shape steps as CUDA graphs; the device step eager, as one CUDA graph, and
compiled), the lookup chain (today's loop; the device step as one CUDA graph, and compiled) and greedy SPD (runtime=local eager,
local with graphs, runtime=streams with graphs off and on), a hybrid target's AR and SPD (a random Qwen3.5 at
the 4B's shape), the rows themselves in bench/gpu_rows.py, every figure from one run, beside the bandwidth
roofline: weight bytes read per token over the copy bandwidth measured here. Every SPD row is checked token for
token against the suite's AR in the same dtype and the same step kind (eager or fixed-shape).
Then each stage's step timed alone and all stages launched together on their streams: whether they overlap.

    python -m bench.gpu --device cuda --dtypes bfloat16,float32 --limit 20 --max-new-tokens 128
    python -m bench.gpu --device cpu --dtypes float32 --limit 1 --max-new-tokens 8 --no-compile --hybrid-layers 4
                                                                                               # a smoke run
On CPU there are no graphs and no streams: the graph rows run the same fixed-shape steps eagerly.
Writes docs/results/gpu_<device>_<dtypes>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from spd.models.checkpoint import load_checkpoint
from spd.config import GenerateConfig, load_config
from spd.eval.harness import machine
from spd.eval.output import write_json
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.runtime.device_step import Graphed
from spd.runtime.streams import StreamStages
from spd.verify.sampling import SamplingParams
from spd.session import open_session
from spd.targets.stages import StagedTarget
from spd.targets.timing import sync

GREEDY = SamplingParams()
# Inductor's code alone (`_compiled`), and captured in the suite's CUDA graph, every bucket in one pool
# (`_compiled_graphs`: the combination closest to transformers' static cache + compile)
COMPILED = ("suite_ar_device_compiled", "lookup_device_compiled", "default_device_compiled", "spd_device_compiled",
            "suite_ar_device_compiled_graphs", "default_device_compiled_graphs")


def copy_bandwidth(device: torch.device, mib: int = 512, repeats: int = 10) -> float:
    """Bytes/s of a large on-device copy (one read + one write per byte): the bandwidth a decode step can use."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * repeats / (time.perf_counter() - start)


def timed(device, fn) -> tuple[list[int], float]:
    sync(device)
    start = time.perf_counter()
    tokens = fn()
    sync(device)
    return tokens, time.perf_counter() - start


# What a row costs before and while it is timed, by kind, to skip (with the estimate recorded) a row the time left
# cannot hold: (seconds for each step built — a bucket captured or compiled, a static cache's new prompt length —,
# seconds a token). CUDA: the H200 runs (docs/gpu.md): eager ~30 ms a token, a graph's replay ~6 ms, a capture ~2 s,
# Inductor 15-40 s a compile, transformers' static cache ~22 s a new length; CPU: the tiny rehearsal target's.
# "hybrid": the random Qwen3.5 built in memory before its first row (not yet timed on a GPU: a bound, not a reading).
COSTS = {"cuda": {"eager": (0.0, 0.030), "graphs": (2.0, 0.008), "compiled": (40.0, 0.006), "hf": (0.0, 0.040),
                  "hf_compile": (22.0, 0.004), "hybrid": (20.0, 0.060)},
         "cpu": {"eager": (0.0, 0.010), "graphs": (0.0, 0.010), "compiled": (20.0, 0.010), "hf": (0.0, 0.010),
                 "hf_compile": (2.0, 0.010), "hybrid": (1.0, 0.010)}}


class Lazy:
    """A decoder (or model) built on first use: inside its row's guard, and never for a row that is skipped."""

    def __init__(self, build: Callable[[], object]):
        self.build, self.value = build, None

    def __call__(self):
        if self.value is None:
            self.value = self.build()
        return self.value


@dataclass
class RowSpec:
    """One row: `run(ids)` decodes a prompt greedily; `kind` prices it (COSTS); `builds` how many steps it builds
    (buckets, or prompt lengths); `reference` the row whose outputs it must equal (None: it is not checked)."""
    name: str
    kind: str
    run: Callable[[list[int]], list[int]]
    builds: int | Callable[[], int] = 1      # a callable builds the row's decoder (Lazy) to count its buckets
    reference: str | None = "suite_ar_fixed_eager"
    compiled: bool = False
    stats: list | None = None        # a pipeline's decode stats, appended by `run` (L'acc = n * N / K)
    n: int = 1
    extra: Callable[[], dict] | None = None
    margin: Callable[[list[int]], float] | None = None     # the top-2 margin of its own target (a hybrid row's)


def estimate_s(spec: RowSpec, prompts, max_new: int, device: torch.device) -> float:
    """Seconds the row is expected to take: its builds, and every prompt decoded twice (the verdict's untimed pass,
    which also captures and compiles, then the timed one)."""
    setup, per_token = COSTS["cuda" if device.type == "cuda" else "cpu"][spec.kind]
    builds = spec.builds() if callable(spec.builds) else spec.builds
    return setup * builds * (len({len(p) for p in prompts}) if spec.kind == "hf_compile" else 1) + \
        2 * per_token * max_new * len(prompts)


def first_difference(out: list[int], ref: list[int]) -> int | None:
    if out == ref:
        return None
    return next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))


def verdict(outputs: list[list[int]], references: list[list[int]], prompts, margin_of) -> dict:
    """Greedy output against the reference, prompt by prompt: where it first differs, both tokens there and the
    target's top-2 margin after the reference's prefix. Only exact ties (margin 0) may differ: "ties"; any other
    difference: "invalid"."""
    differences = []
    for i, (out, ref, ids) in enumerate(zip(outputs, references, prompts)):
        at = first_difference(out, ref)
        if at is None:
            continue
        margin = margin_of(ids + ref[:at]) if at < len(ref) else None
        differences.append({"prompt": i, "position": at, "row_tokens": out[at: at + 3], "ar_tokens": ref[at: at + 3],
                            "top2_margin": margin, "exact_tie": margin == 0.0})
    status = "equal" if not differences else "ties" if all(d["exact_tie"] for d in differences) else "invalid"
    return {"verdict": status, "ar_match": len(prompts) - len(differences), "prompts": len(prompts),
            "differences": differences}


def run_rows(specs: list[RowSpec], prompts, max_new: int, device, rows: dict, saved=lambda: None,
             deadline: float | None = None, only: frozenset[str] | None = None, compile: bool = True,
             margin_of=None, outputs: dict | None = None, ended=None) -> dict:
    """Every row under one guard, in order: skipped (with the reason) when not asked, when compile is off for a
    compiled row, when `rows` already holds its result and outputs (a resumed run), or when the time left before
    `deadline` cannot hold its estimate; otherwise each prompt decoded untimed (the verdict against its reference,
    and every capture and compile the timed pass will need), then timed. An exception is the row's result. `saved()`
    runs after every row, so a killed step keeps every row it finished; `ended(name, row)` too (bench.gpu_steps: the
    row appended to $OUT at once). A resumed row's greedy outputs (`outputs`, saved with every measured row) are the
    reference of the rows measured after it."""
    outputs = {} if outputs is None else outputs
    for spec in specs:
        if only is not None and spec.name not in only:
            rows[spec.name] = {"skipped": "not asked"}
        elif not compile and spec.compiled:
            rows[spec.name] = {"skipped": "compile off"}
        elif spec.name in rows and ("outputs" in rows[spec.name] or "error" in rows[spec.name]):
            # measured by an earlier call: kept as it was, its outputs the reference of the rows after it (a row
            # saved without them, before they were kept, is measured again: its verdicts would be lost)
            rows[spec.name]["resumed"] = True
            if "outputs" in rows[spec.name]:
                outputs.setdefault(spec.name, rows[spec.name]["outputs"])
            continue
        else:
            try:
                need = estimate_s(spec, prompts, max_new, device)     # may build the row's decoder (Lazy)
            except Exception as e:
                need = e
            left = None if deadline is None else deadline - time.time()
            if isinstance(need, Exception):
                rows[spec.name] = {"error": f"{type(need).__name__}: {str(need)[:500]}",
                                   "traceback": "".join(traceback.format_exception(need))[-4000:]}
            elif left is not None and left < need:
                rows[spec.name] = {"skipped": "time box", "estimate_s": round(need, 1), "left_s": round(left, 1)}
            else:
                rows[spec.name] = measure(spec, prompts, device, margin_of, outputs)
        saved()
        if ended is not None:
            ended(spec.name, rows[spec.name])
    return rows


def measure(spec: RowSpec, prompts, device, margin_of, outputs: dict) -> dict:
    try:
        warm, builds_before = [], Graphed.builds
        tokens, seconds, first, timed_builds, mine = 0, 0.0, 0.0, 0, []
        for ids in prompts:
            # the untimed pass first: the same prompt runs the same buckets and the same cache length, so every
            # capture and compile the timed pass needs happens here (a user pays them once, at start-up)
            out, s = timed(device, lambda: spec.run(ids))
            before = Graphed.builds
            again, s2 = timed(device, lambda: spec.run(ids))
            timed_builds += Graphed.builds - before
            warm.append(out)
            mine.append(again)
            tokens, seconds, first = tokens + len(again), seconds + s2, first + s
        row = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "first_call_seconds": first, "steps_built": Graphed.builds - builds_before,
               "steps_built_while_timed": timed_builds, "repeatable": warm == mine}
        outputs[spec.name] = warm
        row["outputs"] = warm        # a later call's verdicts read them (--resume)
        if spec.reference is not None and spec.reference in outputs:
            row.update(verdict(warm, outputs[spec.reference], prompts, spec.margin or margin_of or (lambda ids: None)))
            row["reference"] = spec.reference
        if spec.stats:
            stats = spec.stats[len(spec.stats) // 2:]       # the timed passes' (each prompt ran twice)
            N, K = sum(s.N for s in stats), sum(s.K for s in stats)
            row["eal"] = N / K * spec.n if K else None
        if spec.extra:
            row.update(spec.extra())
        return row
    except Exception as e:   # a row that fails keeps the others (the H200 run of 2026-11-27: inductor's graphs)
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-4000:]}


def top2(staged_whole: StagedTarget, ids: list[int]) -> tuple[float, float]:
    """The target's top-2 logit gap after `ids` (how near a tie the greedy choice there was) and its top logit."""
    with torch.no_grad():
        hidden, _ = staged_whole.forward_all(torch.tensor([ids], device=staged_whole.device), None)
        top = torch.topk(staged_whole.logits(hidden[0, -1]).float(), 2).values
    return float(top[0] - top[1]), float(top[0])


def capture_of(session) -> frozenset[int]:
    """The layers SPD's drafter reads: what the decoder's stage steps capture."""
    return frozenset(session.drafter().layers_needed(session.staged.bounds))


def stage_overlap(executor: StreamStages, staged: StagedTarget, prompt_ids: list[int], device, capture=frozenset(),
                  repeats: int = 50):
    """Seconds per step of each stage alone, and of all stages launched together on their streams, each repeat
    fenced as the decoder fences a step (the stages wait for the caller's stream, the caller waits for them, and
    the host waits for the verdict). capture: the layers the decoder's drafter reads (the steps timed are its
    steps, with their captured-layer copies)."""
    executor.prefill(prompt_ids, frozenset(capture), len(prompt_ids) + 8)
    pos = len(prompt_ids)
    entering = [torch.zeros(1, 1, staged.config.hidden_size, device=device, dtype=staged.dtype)] * staged.n
    streams = executor.streams or []

    def step(stages):
        caller = torch.cuda.current_stream(device) if streams else None
        for stream in streams:                    # what launch does: the stages wait for the caller's work
            stream.wait_stream(caller)
        for stage in stages:
            with executor._stream(stage):
                executor.steps[stage](entering[stage], pos)
        for stream in streams:                    # what collect does
            caller.wait_stream(stream)
        sync(device)                              # the verdict read: one host sync per step

    alone = []
    for stage in range(staged.n):
        step([stage])
        _, s = timed(device, lambda: [step([stage]) for _ in range(repeats)])
        alone.append(s / repeats)
    everything = list(range(staged.n))
    step(everything)
    _, s = timed(device, lambda: [step(everything) for _ in range(repeats)])
    return {"stage_alone_s": alone, "sum_alone_s": sum(alone), "together_s": s / repeats,
            "overlap": sum(alone) / (s / repeats)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--limit", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--checkpoint", default=None, help="default: the shipped module for n = 5")
    ap.add_argument("--no-compile", action="store_true", help="skip HF static cache + torch.compile")
    ap.add_argument("--eagle3-checkpoint", default=None, help="an EAGLE-3 module for eagle3_device_graphs (default: "
                    "an untrained one: the step's cost at tau ~ 1)")
    ap.add_argument("--no-hybrid", action="store_true", help="skip the hybrid target's rows (a random Qwen3.5)")
    ap.add_argument("--hybrid-layers", type=int, default=None, help="the hybrid's layers (default the 4B's 32)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from bench import gpu_rows      # the rows import this module's machinery

    device = torch.device(args.device)
    result = {"device": machine(device), "max_new_tokens": args.max_new_tokens, "limit_per_dataset": args.limit,
              "copy_bandwidth_bytes_per_s": copy_bandwidth(device), "runs": {}}
    for dtype in args.dtypes.split(","):
        overrides = [f"device={args.device}", f"dtype={dtype}"] + ([f"checkpoint={args.checkpoint}"]
                                                                   if args.checkpoint else [])
        session = open_session(load_config(GenerateConfig, None, overrides))
        tok = session.loaded.tokenizer
        prompts = [chat_prompt_ids(tok, q["turns"][0]) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
        weight_bytes = sum(p.numel() * p.element_size() for p in session.loaded.model.parameters())
        whole = StagedTarget(session.loaded.model, 1)
        eagle3 = (lambda: load_checkpoint(args.eagle3_checkpoint, whole, session.loaded)) \
            if args.eagle3_checkpoint else None
        specs, executors = gpu_rows.speed_specs(
            session, args.max_new_tokens, device, getattr(torch, dtype), eagle3, hybrid=not args.no_hybrid,
            hybrid_shape={"num_hidden_layers": args.hybrid_layers} if args.hybrid_layers else None)
        rows = gpu_rows.run_speed(specs, prompts, args.max_new_tokens, device, {}, compile=not args.no_compile,
                                  margin_of=lambda ids: top2(whole, ids)[0])
        roofline = result["copy_bandwidth_bytes_per_s"] / weight_bytes
        for row in rows.values():
            if "tokens_per_s" in row:            # a skipped row has none
                row["fraction_of_roofline"] = row["tokens_per_s"] / roofline
        result["runs"][dtype] = {"weight_bytes": weight_bytes, "roofline_tokens_per_s": roofline, "rows": rows,
                                 "n": session.staged.n, "stage_bounds": session.staged.bounds,
                                 "checkpoint": session.spec.module.checkpoint,
                                 "stage_overlap": stage_overlap(executors["spd_streams_graphs"](), session.staged,
                                                                prompts[0], device, capture_of(session))}
        print(f"[gpu] {dtype}: roofline {roofline:.0f} tok/s; " +
              ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in rows.items() if "tokens_per_s" in v), flush=True)
    out = args.out or f"docs/results/gpu_{device.type}_{args.dtypes.replace(',', '_')}.json"
    write_json(out, result)
    print(json.dumps({d: {k: round(v["tokens_per_s"], 1) for k, v in r["rows"].items() if "tokens_per_s" in v}
                      for d, r in result["runs"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
