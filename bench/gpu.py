"""Decoding speed against the hardware limit: tokens/s of HF `generate` (dynamic cache; static cache +
`torch.compile`), this suite's AR (eager; fixed-shape steps as CUDA graphs; the device step eager, as one CUDA graph, and
compiled), the lookup chain (today's loop; the device step as one CUDA graph, and compiled) and greedy SPD (runtime=local eager,
local with graphs, runtime=streams with graphs off and on), a hybrid target's AR and SPD (a random Qwen3.5 at
the 4B's shape, `hybrid_rows`), every figure from one run, beside the bandwidth
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
from spd.decoding import Request
from spd.engine import build_decoder
from spd.eval.harness import machine
from spd.eval.output import write_json
from spd.methods import AR, METHODS, PIPELINE
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.drafters.eagle3_device import Eagle3DeviceDrafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.selfdraft import SelfDraftDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.models.eagle3 import Eagle3Module
from spd.runtime.chain import ChainDecoder
from spd.runtime.device_chain import DeviceChainDecoder
from spd.runtime.device_pipeline import DevicePipelineDecoder
from spd.runtime.device_step import Graphed
from spd.runtime.stages import reference_kind, stage_executor
from spd.runtime.streams import StreamStages
from spd.verify.sampling import SamplingParams
from spd.session import open_session
from spd.targets.stages import StagedTarget
from spd.targets.timing import sync

GREEDY = SamplingParams()
# the SPD rows' executors, and the AR row each is checked against (spd.runtime.stages.reference_kind)
SPD_ROWS = {"spd_local_eager": "local", "spd_local_graphs": "graphs", "spd_streams_eager": "streams",
            "spd_streams_graphs": "streams_graphs"}
AR_ROWS = {None: "suite_ar_eager", "fixed": "suite_ar_fixed_eager", "graphs": "suite_ar_graphs"}
# Inductor's code alone (`_compiled`), and captured in the suite's CUDA graph, every bucket in one pool
# (`_compiled_graphs`: the combination closest to transformers' static cache + compile)
COMPILED = ("suite_ar_device_compiled", "lookup_device_compiled", "default_device_compiled", "spd_device_compiled",
            "suite_ar_device_compiled_graphs", "default_device_compiled_graphs")
# The order a speed step measures in: the reference of every verdict, then what both goals are measured against
# (transformers' static cache + compile, the suite's AR through the device step), then the speculative rows by the
# speedup expected of them on a launch-bound GPU (drafts inside the step first, host drafters next, the slower host
# loops last), every compiled row after all of them (minutes of compilation each). A row not named keeps its place
# after the named ones.
BASELINE = ("suite_ar_fixed_eager", "hf_static_compile", "suite_ar_device_graphs")
EXPECTED = ("eagle3_tree_device_graphs", "eagle3_device_graphs", "default_device_graphs", "spd_device_graphs",
            "spd_lookup_device_graphs", "lookup_device_graphs", "selfdraft_device_graphs", "suite_ar_graphs",
            "spd_streams_graphs", "spd_local_graphs", "lookup_chain", "selfdraft_chain", "suite_ar_device_eager",
            "hf_dynamic", "suite_ar_eager", "spd_streams_eager", "spd_local_eager",
            "hybrid_ar_eager", "hybrid_ar_device_graphs", "hybrid_spd_eager")
LOOKUP_K, SUFFIX_K, EAGLE3_K = 7, 15, 5     # the methods' draft lengths (spd.methods)
SELFDRAFT_K = METHODS["selfdraft"].draft_length


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


def speed_order(specs: list["RowSpec"]) -> list["RowSpec"]:
    """BASELINE, then EXPECTED, then the rest, the compiled rows last (module comment above)."""
    rank = {name: i for i, name in enumerate(BASELINE + EXPECTED)}
    return sorted(specs, key=lambda spec: (spec.compiled, rank.get(spec.name, len(rank))))


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
    compiled row, when `rows` already holds its result (a resumed run), or when the time left before `deadline`
    cannot hold its estimate; otherwise each prompt decoded untimed (the verdict against its reference, and every
    capture and compile the timed pass will need), then timed. An exception is the row's result. `saved()` runs
    after every row, so a killed step keeps every row it finished; `ended(name, row)` too (bench.gpu_steps: the row
    appended to $OUT at once). A resumed row's greedy outputs (`outputs`, saved with every measured row) are the
    reference of the rows measured after it."""
    outputs = {} if outputs is None else outputs
    for spec in specs:
        if only is not None and spec.name not in only:
            rows[spec.name] = {"skipped": "not asked"}
        elif not compile and spec.compiled:
            rows[spec.name] = {"skipped": "compile off"}
        elif spec.name in rows and ("tokens_per_s" in rows[spec.name] or "error" in rows[spec.name]):
            rows[spec.name]["resumed"] = True        # measured by an earlier call: kept as it was
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
            row.update(verdict(warm, outputs[spec.reference], prompts, margin_of or (lambda ids: None)))
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


def hf_rows(model, prompts, max_new, device, compile_static: bool, eos, deadline: float | None = None,
            only: frozenset[str] | None = None, rows: dict | None = None, saved=lambda: None,
            margin_of=None, outputs: dict | None = None) -> dict:
    """transformers' generate: dynamic cache, and static cache + its own torch.compile (`compile_static`), under
    run_rows's guard, checked against the suite's fixed-shape AR where `outputs` holds it."""
    rows = {} if rows is None else rows

    def row(name, kind, **extra):
        def run(ids):
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=list(eos) or None, pad_token_id=0, **extra)
            return out[0, len(ids):].tolist()
        # transformers skips compilation silently where its criteria fail (e.g. CPU): say whether it compiled
        return RowSpec(name, kind, run, compiled=bool(extra),
                       extra=(lambda: {"compiled": hasattr(model, "_compiled_call")}) if extra else None)
    # A static cache makes `generate` compile its own decode step (mode reduce-overhead) on CUDA; wrapping
    # model.forward by hand as well (the H200 runs before 2026-11-27 16:09) compiled twice and read CUDA-graph outputs
    # a later replay had overwritten. Its cache is as long as prompt + max_new, so each new prompt length compiles
    # again: run_rows's untimed pass of each prompt holds those (the H200 run of 2026-11-27 21:24 timed them).
    specs = [row("hf_dynamic", "hf"), row("hf_static_compile", "hf_compile", cache_implementation="static")]
    return run_rows(specs, prompts, max_new, device, rows, saved, deadline, only, compile_static, margin_of, outputs)


def suite_rows(session, prompts, max_new, device, deadline: float | None = None,
               only: frozenset[str] | None = None, compile: bool = True, eagle3=None, rows: dict | None = None,
               saved=lambda: None, outputs: dict | None = None) -> tuple[dict, dict]:
    """The suite's rows under run_rows's guard (see there), the compiled ones last; rows: a resumed run's rows (kept);
    compile: False skips the rows through torch.compile (minutes of compilation on a CPU). eagle3: an EAGLE-3
    module for the whole target (None: an untrained one)."""
    staged, eos = session.staged, session.eos_ids
    whole = StagedTarget(session.loaded.model, 1)
    eagle3 = eagle3 if eagle3 is not None else Eagle3Module.from_target(whole)
    ar_eager = build_decoder(AR, whole, eos)
    ar_fixed = build_decoder(AR, whole, eos, stages=stage_executor("fixed", whole))   # fixed-shape steps, no graphs
    ar_graphs = build_decoder(AR, whole, eos, stages=stage_executor("graphs", whole))
    request = Request(max_new, GREEDY)
    min_n, max_n = session.spec.lookup.min_ngram, session.spec.lookup.max_ngram
    chains = {"suite_ar_device_eager": DeviceChainDecoder(whole, eos),
              "suite_ar_device_graphs": DeviceChainDecoder(whole, eos, cuda_graphs=True),
              "suite_ar_device_compiled": DeviceChainDecoder(whole, eos, compile="inductor"),
              "lookup_chain": ChainDecoder(whole, LookupDrafter(min_n, max_n), eos, LOOKUP_K),
              "lookup_device_graphs": DeviceChainDecoder(whole, eos, LookupDrafter(min_n, max_n), LOOKUP_K,
                                                         cuda_graphs=True),
              "lookup_device_compiled": DeviceChainDecoder(whole, eos, LookupDrafter(min_n, max_n), LOOKUP_K,
                                                           compile="inductor"),
              # the CPU default's trees (context statistics, W = 4, 16 nodes), verified in the step
              "default_device_graphs": DeviceChainDecoder(whole, eos, SuffixDrafter(), SUFFIX_K, cuda_graphs=True,
                                                          width=4, budget=16),
              "default_device_compiled": DeviceChainDecoder(whole, eos, SuffixDrafter(), SUFFIX_K,
                                                            compile="inductor", width=4, budget=16),
              # EAGLE-3's chain drafted inside the step (a module given by --eagle3-checkpoint, else untrained: the
              # step's cost at tau ~ 1)
              "eagle3_device_graphs": DeviceChainDecoder(whole, eos, None, EAGLE3_K, cuda_graphs=True,
                                                         device_drafter=Eagle3DeviceDrafter(eagle3, whole.embed)),
              # ... and its dynamic trees (W = 4, 16 nodes), grown and verified inside the step
              "eagle3_tree_device_graphs": DeviceChainDecoder(whole, eos, None, EAGLE3_K, cuda_graphs=True, width=4,
                                                              budget=16,
                                                              device_drafter=Eagle3DeviceDrafter(eagle3, whole.embed)),
              # Self-Draft (N = L = 6 branch rows in every step; its context cache, no corpus: no datastore there)
              "selfdraft_chain": ChainDecoder(whole, SelfDraftDrafter(), eos, SELFDRAFT_K),
              "selfdraft_device_graphs": DeviceChainDecoder(whole, eos, SelfDraftDrafter(), SELFDRAFT_K,
                                                            cuda_graphs=True),
              # SPD's whole pipeline step (every stage and the module's draft on their streams) as one graph
              "spd_device_graphs": DevicePipelineDecoder(staged, session.module, eos, cuda_graphs=True),
              "spd_device_compiled": DevicePipelineDecoder(staged, session.module, eos, compile="inductor"),
              # ... with the context lookup in front of the module (draft_source=lookup+module)
              "spd_lookup_device_graphs": DevicePipelineDecoder(staged, session.module, eos, cuda_graphs=True,
                                                                lookup=(min_n, max_n))}

    def decoding(decoder):
        return lambda ids: decoder.generate(ids, request).token_ids

    def kind_of(name: str) -> str:
        return "compiled" if name in COMPILED else "graphs" if name.endswith("_graphs") or "_device_" in name \
            else "eager"

    # the fixed-shape AR first: every other row's verdict is against its outputs (the same dtype, the same step kind
    # as the device step); the device-step rows next, the compiled ones last (minutes of compilation each)
    specs = [RowSpec("suite_ar_fixed_eager", "eager", decoding(ar_fixed), reference=None),
             RowSpec("suite_ar_eager", "eager", decoding(ar_eager)),
             RowSpec("suite_ar_graphs", "graphs", decoding(ar_graphs))]
    for name, decoder in chains.items():
        specs.append(RowSpec(name, kind_of(name), decoding(decoder), builds=len(getattr(decoder, "buckets", [1])),
                             compiled=name in COMPILED,
                             extra=lambda d=decoder: {"tau_last_prompt": getattr(d.stats, "tau", None)
                                                      or getattr(d.stats, "eal", None)}))
    executors = {name: stage_executor(kind, staged) for name, kind in SPD_ROWS.items()}
    for name, ex in executors.items():
        decoder = build_decoder(PIPELINE, staged, eos, session.drafter(True), stages=ex)
        stats = []

        def run(ids, decoder=decoder, stats=stats):
            out = decoder.generate(ids, request)
            stats.append(out.stats)
            return out.token_ids
        # lossless: each SPD row against the suite's AR with the same kind of step
        specs.append(RowSpec(name, "graphs" if "graphs" in name else "eager", run, stats=stats, n=staged.n,
                             reference=AR_ROWS[reference_kind(SPD_ROWS[name])]))
    specs.sort(key=lambda spec: spec.compiled)       # stable: the compiled rows last, each group in its order
    if only is not None:   # a row asked for brings the reference its verdict reads
        only = only | {spec.reference for spec in specs if spec.name in only and spec.reference}
    rows = {} if rows is None else rows
    run_rows(specs, prompts, max_new, device, rows, saved, deadline, only, compile,
             lambda ids: top2(whole, ids)[0], outputs)
    return rows, executors


def hybrid_rows(prompts, max_new, device, dtype: torch.dtype, deadline: float | None = None,
                only: frozenset[str] | None = None, rows: dict | None = None, saved=lambda: None, n: int = 4,
                shape: dict | None = None) -> dict:
    """A hybrid target (Qwen3.5 at the 4B's shape, bench.hybrid_state.SHAPE_4B, random weights built in memory:
    no hub here): AR eager and through the device step (its linear-attention states indexed by position, one CUDA
    graph), and SPD with n stages at a fixed trace — the oracle drafts AR's own tokens while a random module's
    compute runs, so K = N + n - 2 and the row times the pipeline full. shape: config fields that replace the 4B's
    (a CPU rehearsal's small hybrid)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from bench.hybrid_state import SHAPE_4B
    from spd.drafters.reference import ReferenceDrafter
    from spd.drafters.spd_module import ModuleDrafter
    from spd.models.module import SpeculationModule
    from spd.runtime.pipeline import PipelineDecoder

    config = Qwen3_5TextConfig(**{**SHAPE_4B, **(shape or {})})
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    staged, whole = StagedTarget(model, n), StagedTarget(model, 1)
    ar = build_decoder(AR, whole, frozenset())
    module = SpeculationModule.from_target(staged, 1)
    request, continuation, stats = Request(max_new, GREEDY), {}, []

    def run_ar(ids):
        continuation[tuple(ids)] = ar.generate(ids, request).token_ids
        return continuation[tuple(ids)]

    def run_spd(ids):
        drafter = ReferenceDrafter(list(ids) + continuation[tuple(ids)], config.vocab_size,
                                   inner=ModuleDrafter(module))
        out = PipelineDecoder(staged, drafter, frozenset()).generate(ids, request)
        stats.append(out.stats)
        return out.token_ids
    device_ar = DeviceChainDecoder(whole, frozenset(), cuda_graphs=True)
    specs = [RowSpec("hybrid_ar_eager", "eager", run_ar, reference=None),
             RowSpec("hybrid_ar_device_graphs", "graphs", lambda ids: device_ar.generate(ids, request).token_ids,
                     reference="hybrid_ar_eager"),
             RowSpec("hybrid_spd_eager", "eager", run_spd, stats=stats, n=n, reference="hybrid_ar_eager")]
    if only is not None and only & {"hybrid_spd_eager", "hybrid_ar_device_graphs"}:
        only = only | {"hybrid_ar_eager"}
    rows = {} if rows is None else rows
    run_rows(specs, prompts, max_new, device, rows, saved, deadline, only,
             margin_of=lambda ids: top2(whole, ids)[0])
    return rows


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
        eagle3 = None
        if args.eagle3_checkpoint:
            whole = StagedTarget(session.loaded.model, 1)
            eagle3 = load_checkpoint(args.eagle3_checkpoint, whole, session.loaded)
        outputs = {}
        rows, executors = suite_rows(session, prompts, args.max_new_tokens, device, compile=not args.no_compile,
                                     eagle3=eagle3, outputs=outputs)
        whole = StagedTarget(session.loaded.model, 1)
        hf_rows(session.loaded.model, prompts, args.max_new_tokens, device, not args.no_compile, session.eos_ids,
                rows=rows, margin_of=lambda ids: top2(whole, ids)[0], outputs=outputs)
        if not args.no_hybrid:
            hybrid_rows(prompts, args.max_new_tokens, device, getattr(torch, dtype), rows=rows,
                        shape={"num_hidden_layers": args.hybrid_layers} if args.hybrid_layers else None)
        roofline = result["copy_bandwidth_bytes_per_s"] / weight_bytes
        for row in rows.values():
            if "tokens_per_s" in row:            # a skipped row has none
                row["fraction_of_roofline"] = row["tokens_per_s"] / roofline
        result["runs"][dtype] = {"weight_bytes": weight_bytes, "roofline_tokens_per_s": roofline, "rows": rows,
                                 "n": session.staged.n, "stage_bounds": session.staged.bounds,
                                 "checkpoint": session.spec.module.checkpoint,
                                 "stage_overlap": stage_overlap(executors["spd_streams_graphs"], session.staged,
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
