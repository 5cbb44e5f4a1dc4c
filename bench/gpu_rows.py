"""The speed table's rows (bench/gpu.py measures them): transformers' `generate`, the suite's AR and its
speculative methods through every kind of step, and a hybrid target's rows, each a `RowSpec` whose decoder is built
on first use (`Lazy`), so that building one is inside its row's guard and a row that is skipped builds nothing — the
hybrid's random Qwen3.5 at the 4B's shape included. `run_speed` measures them all in one order (`speed_order`)."""

from __future__ import annotations

import torch

from bench.gpu import COMPILED, GREEDY, Lazy, RowSpec, run_rows, top2
from spd.decoding import Request
from spd.drafters.eagle3_device import Eagle3DeviceDrafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.selfdraft import SelfDraftDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.engine import build_decoder
from spd.methods import AR, METHODS, PIPELINE
from spd.models.eagle3 import Eagle3Module
from spd.runtime.chain import ChainDecoder
from spd.runtime.device_chain import DeviceChainDecoder
from spd.runtime.device_pipeline import DevicePipelineDecoder
from spd.runtime.stages import reference_kind, stage_executor
from spd.targets.stages import StagedTarget

# the SPD rows' executors, and the AR row each is checked against (spd.runtime.stages.reference_kind)
SPD_ROWS = {"spd_local_eager": "local", "spd_local_graphs": "graphs", "spd_streams_eager": "streams",
            "spd_streams_graphs": "streams_graphs"}
AR_ROWS = {None: "suite_ar_eager", "fixed": "suite_ar_fixed_eager", "graphs": "suite_ar_graphs"}
# The order a speed step measures in: the reference of every verdict, then what both goals are measured against
# (transformers' static cache + compile, the suite's AR through the device step), then the speculative rows by the
# speedup expected of them on a launch-bound GPU (drafts inside the step first, host drafters next, the slower host
# loops last), every other compiled row after all of them (minutes of compilation each). A row not named keeps its
# place after the named ones.
BASELINE = ("suite_ar_fixed_eager", "hf_static_compile", "suite_ar_device_graphs")
EXPECTED = ("eagle3_tree_device_graphs", "eagle3_device_graphs", "default_device_graphs", "spd_device_graphs",
            "spd_lookup_device_graphs", "lookup_device_graphs", "selfdraft_device_graphs", "suite_ar_graphs",
            "spd_streams_graphs", "spd_local_graphs", "lookup_chain", "selfdraft_chain", "suite_ar_device_eager",
            "hf_dynamic", "suite_ar_eager", "spd_streams_eager", "spd_local_eager",
            "hybrid_ar_eager", "hybrid_ar_device_graphs", "hybrid_spd_eager",
            # compiled: Inductor's code captured in the suite's graph first (the nearest to transformers' compiled
            # static cache), then Inductor's code alone
            "suite_ar_device_compiled_graphs", "default_device_compiled_graphs", "suite_ar_device_compiled",
            "default_device_compiled", "spd_device_compiled", "lookup_device_compiled")
LOOKUP_K, SUFFIX_K, EAGLE3_K = 7, 15, 5     # the methods' draft lengths (spd.methods)
SELFDRAFT_K = METHODS["selfdraft"].draft_length
BACKEND = "inductor"          # the compiled rows' torch.compile backend


def speed_order(specs: list[RowSpec]) -> list[RowSpec]:
    """BASELINE first (hf_static_compile too, though it compiles), then the uncompiled rows by EXPECTED, then the
    compiled ones; a row's reference always runs before it (BASELINE and EXPECTED list references first)."""
    rank = {name: i for i, name in enumerate(BASELINE + EXPECTED)}
    return sorted(specs, key=lambda s: (s.name not in BASELINE, s.compiled and s.name not in BASELINE,
                                        rank.get(s.name, len(rank))))


def with_references(only: frozenset[str] | None, specs: list[RowSpec]) -> frozenset[str] | None:
    """The rows asked for and every reference their verdicts read, transitively."""
    if only is None:
        return None
    refs = {spec.name: spec.reference for spec in specs}
    out, todo = set(only), list(only)
    while todo:
        ref = refs.get(todo.pop())
        if ref and ref not in out:
            out.add(ref)
            todo.append(ref)
    return frozenset(out)


def run_speed(specs: list[RowSpec], prompts, max_new: int, device, rows: dict, saved=lambda: None,
              deadline: float | None = None, only: frozenset[str] | None = None, compile: bool = True,
              margin_of=None, outputs: dict | None = None, ended=None) -> dict:
    """Every row in speed_order under bench.gpu.run_rows's guard (the rows asked for bring their references)."""
    return run_rows(speed_order(specs), prompts, max_new, device, rows, saved, deadline,
                    with_references(only, specs), compile, margin_of, outputs, ended)


def decoding(decoder: Lazy, request: Request):
    return lambda ids: decoder().generate(ids, request).token_ids


def buckets(decoder: Lazy):
    """The steps a row builds (its decoder's row buckets): counting them builds the decoder, inside the guard."""
    return lambda: len(getattr(decoder(), "buckets", [1]))


def hf_specs(model, max_new: int, device, eos) -> list[RowSpec]:
    """transformers' generate: dynamic cache, and static cache + its own torch.compile."""
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
    return [row("hf_dynamic", "hf"), row("hf_static_compile", "hf_compile", cache_implementation="static")]


def suite_specs(session, max_new: int, device, eagle3=None) -> tuple[list[RowSpec], dict[str, Lazy]]:
    """The suite's rows, and SPD's stage executors by row (bench.gpu.stage_overlap times one). eagle3: a callable
    giving the EAGLE-3 module for the whole target (the shipped head; None: an untrained one, the step's cost at
    tau ~ 1)."""
    staged, eos = session.staged, session.eos_ids
    whole = StagedTarget(session.loaded.model, 1)
    head = Lazy(eagle3 or (lambda: Eagle3Module.from_target(whole)))
    request = Request(max_new, GREEDY)
    min_n, max_n = session.spec.lookup.min_ngram, session.spec.lookup.max_ngram

    def chain(*args, **kw):
        return Lazy(lambda: DeviceChainDecoder(whole, eos, *args, **kw))

    def eagle3_drafter():
        return Eagle3DeviceDrafter(head(), whole.embed)
    decoders = {
        "suite_ar_fixed_eager": Lazy(lambda: build_decoder(AR, whole, eos, stages=stage_executor("fixed", whole))),
        "suite_ar_eager": Lazy(lambda: build_decoder(AR, whole, eos)),
        "suite_ar_graphs": Lazy(lambda: build_decoder(AR, whole, eos, stages=stage_executor("graphs", whole))),
        "suite_ar_device_eager": chain(),
        "suite_ar_device_graphs": chain(cuda_graphs=True),
        "suite_ar_device_compiled": chain(compile=BACKEND),
        # Inductor's kernels captured in the suite's graph, every bucket in one pool (on a CPU: compiled, no graph)
        "suite_ar_device_compiled_graphs": chain(compile=BACKEND, cuda_graphs=True),
        "lookup_chain": Lazy(lambda: ChainDecoder(whole, LookupDrafter(min_n, max_n), eos, LOOKUP_K)),
        "lookup_device_graphs": Lazy(lambda: DeviceChainDecoder(whole, eos, LookupDrafter(min_n, max_n), LOOKUP_K,
                                                                cuda_graphs=True)),
        "lookup_device_compiled": Lazy(lambda: DeviceChainDecoder(whole, eos, LookupDrafter(min_n, max_n), LOOKUP_K,
                                                                  compile=BACKEND)),
        # the CPU default's trees (context statistics, W = 4, 16 nodes), verified in the step
        "default_device_graphs": Lazy(lambda: DeviceChainDecoder(whole, eos, SuffixDrafter(), SUFFIX_K,
                                                                 cuda_graphs=True, width=4, budget=16)),
        "default_device_compiled": Lazy(lambda: DeviceChainDecoder(whole, eos, SuffixDrafter(), SUFFIX_K,
                                                                   compile=BACKEND, width=4, budget=16)),
        "default_device_compiled_graphs": Lazy(lambda: DeviceChainDecoder(whole, eos, SuffixDrafter(), SUFFIX_K,
                                                                          compile=BACKEND, cuda_graphs=True,
                                                                          width=4, budget=16)),
        # EAGLE-3's chain drafted inside the step, and its dynamic trees (W = 4, 16 nodes) grown and verified there
        "eagle3_device_graphs": Lazy(lambda: DeviceChainDecoder(whole, eos, None, EAGLE3_K, cuda_graphs=True,
                                                                device_drafter=eagle3_drafter())),
        "eagle3_tree_device_graphs": Lazy(lambda: DeviceChainDecoder(whole, eos, None, EAGLE3_K, cuda_graphs=True,
                                                                     width=4, budget=16,
                                                                     device_drafter=eagle3_drafter())),
        # Self-Draft (N = L = 6 branch rows in every step; its context cache, no corpus: no datastore there)
        "selfdraft_chain": Lazy(lambda: ChainDecoder(whole, SelfDraftDrafter(), eos, SELFDRAFT_K)),
        "selfdraft_device_graphs": Lazy(lambda: DeviceChainDecoder(whole, eos, SelfDraftDrafter(), SELFDRAFT_K,
                                                                   cuda_graphs=True)),
        # SPD's whole pipeline step (every stage and the module's draft on their streams) as one graph
        "spd_device_graphs": Lazy(lambda: DevicePipelineDecoder(staged, session.module, eos, cuda_graphs=True)),
        "spd_device_compiled": Lazy(lambda: DevicePipelineDecoder(staged, session.module, eos, compile=BACKEND)),
        # ... with the context lookup in front of the module (draft_source=lookup+module)
        "spd_lookup_device_graphs": Lazy(lambda: DevicePipelineDecoder(staged, session.module, eos, cuda_graphs=True,
                                                                       lookup=(min_n, max_n)))}
    specs = []
    for name, decoder in decoders.items():
        kind = "compiled" if name in COMPILED else "graphs" if name.endswith("_graphs") else "eager"
        specs.append(RowSpec(name, kind, decoding(decoder, request), builds=buckets(decoder),
                             reference=None if name == "suite_ar_fixed_eager" else "suite_ar_fixed_eager",
                             compiled=name in COMPILED,
                             extra=lambda d=decoder: {"tau_last_prompt": getattr(d().stats, "tau", None)
                                                      or getattr(d().stats, "eal", None)}))
    executors = {name: Lazy(lambda kind=kind: stage_executor(kind, staged)) for name, kind in SPD_ROWS.items()}
    for name, executor in executors.items():
        decoder = Lazy(lambda ex=executor: build_decoder(PIPELINE, staged, eos, session.drafter(True), stages=ex()))
        stats = []

        def run(ids, decoder=decoder, stats=stats):
            out = decoder().generate(ids, request)
            stats.append(out.stats)
            return out.token_ids
        # lossless: each SPD row against the suite's AR with the same kind of step
        specs.append(RowSpec(name, "graphs" if "graphs" in name else "eager", run, stats=stats, n=staged.n,
                             reference=AR_ROWS[reference_kind(SPD_ROWS[name])]))
    return specs, executors


def hybrid_specs(max_new: int, device, dtype: torch.dtype, n: int = 4, shape: dict | None = None) -> list[RowSpec]:
    """A hybrid target (Qwen3.5 at the 4B's shape, bench.hybrid_state.SHAPE_4B, random weights built in memory on
    its first row: no hub here): AR eager and through the device step (its linear-attention states indexed by
    position, one CUDA graph), and SPD with n stages at a fixed trace — the oracle drafts AR's own tokens while a
    random module's compute runs, so K = N + n - 2 and the row times the pipeline full. shape: config fields that
    replace the 4B's (a CPU rehearsal's small hybrid)."""
    def build():
        from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

        from bench.hybrid_state import SHAPE_4B
        from spd.models.module import SpeculationModule

        config = Qwen3_5TextConfig(**{**SHAPE_4B, **(shape or {})})
        with torch.device(device):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
        staged, whole = StagedTarget(model, n), StagedTarget(model, 1)
        return {"config": config, "staged": staged, "whole": whole, "ar": build_decoder(AR, whole, frozenset()),
                "module": SpeculationModule.from_target(staged, 1),
                "device_ar": DeviceChainDecoder(whole, frozenset(), cuda_graphs=True)}
    built = Lazy(build)
    request, continuation, stats = Request(max_new, GREEDY), {}, []

    def run_ar(ids):
        continuation[tuple(ids)] = built()["ar"].generate(ids, request).token_ids
        return continuation[tuple(ids)]

    def run_spd(ids):
        from spd.drafters.reference import ReferenceDrafter
        from spd.drafters.spd_module import ModuleDrafter
        from spd.runtime.pipeline import PipelineDecoder

        h = built()
        drafter = ReferenceDrafter(list(ids) + continuation[tuple(ids)], h["config"].vocab_size,
                                   inner=ModuleDrafter(h["module"]))
        out = PipelineDecoder(h["staged"], drafter, frozenset()).generate(ids, request)
        stats.append(out.stats)
        return out.token_ids

    def first():      # the model is built by whichever hybrid row runs first
        return 0 if built.value is not None else 1

    def margin(ids):
        return top2(built()["whole"], ids)[0]
    return [RowSpec("hybrid_ar_eager", "hybrid", run_ar, builds=first, reference=None, margin=margin),
            RowSpec("hybrid_ar_device_graphs", "hybrid",
                    lambda ids: built()["device_ar"].generate(ids, request).token_ids, builds=first,
                    reference="hybrid_ar_eager", margin=margin),
            RowSpec("hybrid_spd_eager", "hybrid", run_spd, builds=first, stats=stats, n=n,
                    reference="hybrid_ar_eager", margin=margin)]


def speed_specs(session, max_new: int, device, dtype: torch.dtype, eagle3=None, hybrid: bool = True,
                hybrid_shape: dict | None = None) -> tuple[list[RowSpec], dict[str, Lazy]]:
    """Every row of the speed table for one loaded target (one dtype), unbuilt."""
    specs, executors = suite_specs(session, max_new, device, eagle3)
    specs += hf_specs(session.loaded.model, max_new, device, session.eos_ids)
    if hybrid:
        specs += hybrid_specs(max_new, device, dtype, shape=hybrid_shape)
    return specs, executors
