"""Decoding speed against the hardware limit: tokens/s of HF `generate` (dynamic cache; static cache +
`torch.compile`), this suite's AR (eager; fixed-shape steps as CUDA graphs; the device step eager, as one CUDA graph, and
compiled), the lookup chain (today's loop; the device step as one CUDA graph, and compiled) and greedy SPD (runtime=local eager,
local with graphs, runtime=streams with graphs off and on), every figure from one run, beside the bandwidth
roofline: weight bytes read per token over the copy bandwidth measured here. Every SPD row is checked token for
token against the suite's AR in the same dtype and the same step kind (eager or fixed-shape).
Then each stage's step timed alone and all stages launched together on their streams: whether they overlap.

    python -m bench.gpu --device cuda --dtypes bfloat16,float32 --limit 20 --max-new-tokens 128
    python -m bench.gpu --device cpu --dtypes float32 --limit 1 --max-new-tokens 8 --no-compile   # a smoke run
On CPU there are no graphs and no streams: the graph rows run the same fixed-shape steps eagerly.
Writes docs/results/gpu_<device>_<dtypes>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from spd.checkpoint import load_checkpoint
from spd.config import GenerateConfig, load_config
from spd.decoding import Request
from spd.engine import build_decoder
from spd.eval.harness import machine
from spd.eval.output import write_json
from spd.methods import AR, METHODS, PIPELINE
from spd.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.drafters.eagle3_device import Eagle3DeviceDrafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.selfdraft import SelfDraftDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.eagle3_module import Eagle3Module
from spd.runtime.chain import ChainDecoder
from spd.runtime.device_chain import DeviceChainDecoder
from spd.runtime.device_pipeline import DevicePipelineDecoder
from spd.runtime.stages import reference_kind, stage_executor
from spd.runtime.streams import StreamStages
from spd.sampling import SamplingParams
from spd.session import open_session
from spd.targets.stages import StagedTarget
from spd.targets.timing import sync

GREEDY = SamplingParams()
# the SPD rows' executors, and the AR row each is checked against (spd.runtime.stages.reference_kind)
SPD_ROWS = {"spd_local_eager": "local", "spd_local_graphs": "graphs", "spd_streams_eager": "streams",
            "spd_streams_graphs": "streams_graphs"}
AR_ROWS = {None: "suite_ar_eager", "fixed": "suite_ar_fixed_eager", "graphs": "suite_ar_graphs"}
# whole-target rows checked against the eager AR: the device step (spd.runtime.device_step) and the lookup chain
CHAIN_ROWS = ("suite_ar_device_eager", "suite_ar_device_graphs", "suite_ar_device_compiled", "lookup_chain",
              "lookup_device_graphs", "lookup_device_compiled", "default_device_graphs", "default_device_compiled",
              "eagle3_device_graphs", "eagle3_tree_device_graphs", "spd_device_graphs", "spd_lookup_device_graphs",
              "selfdraft_chain", "selfdraft_device_graphs",
              "spd_device_compiled")
COMPILED = ("suite_ar_device_compiled", "lookup_device_compiled", "default_device_compiled", "spd_device_compiled")
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


def hf_rows(model, prompts, max_new, device, compile_static: bool, eos, deadline: float | None = None,
            only: frozenset[str] | None = None, rows: dict | None = None, saved=lambda: None) -> dict:
    """deadline (time.time()): rows not started by then are marked skipped; only: the rows to run (None: all).
    Each row goes into `rows` and `saved()` runs as it finishes: a step killed while compiling keeps the others."""
    rows = {} if rows is None else rows
    kinds = [("hf_dynamic", {})]
    if compile_static:
        kinds.append(("hf_static_compile", {"cache_implementation": "static"}))
    for name, extra in kinds:
        if only is not None and name not in only:
            rows[name] = {"skipped": "not asked"}
            continue
        if not compile and name.endswith("_compiled"):
            rows[name] = {"skipped": "compile off"}
            continue
        if deadline is not None and time.time() > deadline:
            rows[name] = {"skipped": "time box"}
            continue

        def run(ids):
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=list(eos) or None, pad_token_id=0, **extra)
            return out[0, len(ids):].tolist()
        try:
            # A static cache makes `generate` compile its own decode step (mode reduce-overhead) on CUDA; wrapping
            # model.forward by hand as well (the H200 runs before 2026-11-27 16:09) compiled twice and read CUDA-graph
            # outputs a later replay had overwritten.
            # Every prompt is run once untimed: a static cache is as long as prompt + max_new, so each new prompt
            # length compiles (and captures) again -- the H200 run of 2026-11-27 21:24 timed those compilations (4.4
            # tokens/s). The first calls' seconds are kept apart as what a user meets on a new length.
            tokens, seconds, first = 0, 0.0, 0.0
            for ids in prompts:
                _, s = timed(device, lambda: run(ids))
                out, s2 = timed(device, lambda: run(ids))
                tokens, seconds, first = tokens + len(out), seconds + s2, first + s
            rows[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                          "first_call_seconds": first}
            if extra:   # transformers skips compilation silently where its criteria fail (e.g. CPU)
                rows[name]["compiled"] = hasattr(model, "_compiled_call")
        except Exception as e:   # a row that fails keeps the others (the H200 run of 2026-11-27: inductor's graphs)
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        saved()
    return rows


def suite_rows(session, prompts, max_new, device, deadline: float | None = None,
               only: frozenset[str] | None = None, compile: bool = True, eagle3=None) -> tuple[dict, dict]:
    """deadline (time.time()): rows not started by then are marked skipped; only: the rows to run (None: all);
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
    runs = {
        "suite_ar_eager": lambda ids: ar_eager.generate(ids, request).token_ids,
        # the device-step rows first: they are what a short box must not miss
        **{name: (lambda ids, d=decoder: d.generate(ids, request).token_ids) for name, decoder in chains.items()},
        "suite_ar_fixed_eager": lambda ids: ar_fixed.generate(ids, request).token_ids,
        "suite_ar_graphs": lambda ids: ar_graphs.generate(ids, request).token_ids,
    }
    executors = {name: stage_executor(kind, staged) for name, kind in SPD_ROWS.items()}
    stats = {}
    for name, ex in executors.items():
        decoder = build_decoder(PIPELINE, staged, eos, session.drafter(True), stages=ex)
        stats[name] = []

        def run(ids, decoder=decoder, name=name):
            out = decoder.generate(ids, request)
            stats[name].append(out.stats)
            return out.token_ids
        runs[name] = run
    rows, outputs = {}, {}
    for name, run in runs.items():
        if only is not None and name not in only:
            rows[name] = {"skipped": "not asked"}
            continue
        if not compile and name in COMPILED:
            rows[name] = {"skipped": "compile off"}
            continue
        if deadline is not None and time.time() > deadline:
            rows[name] = {"skipped": "time box"}
            continue
        run(prompts[0])                                    # warm-up (graph capture)
        stats.get(name, []).clear()
        tokens, seconds, outputs[name] = 0, 0.0, []
        for ids in prompts:
            out, s = timed(device, lambda: run(ids))
            tokens, seconds = tokens + len(out), seconds + s
            outputs[name].append(out)
        rows[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        if name in stats:
            N = sum(s.N for s in stats[name])
            K = sum(s.K for s in stats[name])
            rows[name]["eal"] = N / K * staged.n if K else None
    for name in CHAIN_ROWS:  # lossless: greedy = the eager AR, token for token
        if name in outputs and "suite_ar_eager" in outputs:
            rows[name]["ar_match"] = sum(a == b for a, b in zip(outputs[name], outputs["suite_ar_eager"]))
            rows[name]["prompts"] = len(prompts)
            stats = chains[name].stats
            rows[name]["tau_last_prompt"] = getattr(stats, "tau", None) or getattr(stats, "eal", None)
    for name in executors:   # lossless: each SPD row against the suite's AR with the same kind of step
        reference = outputs.get(AR_ROWS[reference_kind(SPD_ROWS[name])])
        if name not in outputs or reference is None:
            continue
        rows[name]["ar_match"] = sum(a == b for a, b in zip(outputs[name], reference))
        rows[name]["prompts"] = len(prompts)
    return rows, executors


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
        rows, executors = suite_rows(session, prompts, args.max_new_tokens, device, compile=not args.no_compile,
                                     eagle3=eagle3)
        rows.update(hf_rows(session.loaded.model, prompts, args.max_new_tokens, device, not args.no_compile,
                            session.eos_ids))
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
