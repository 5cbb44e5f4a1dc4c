"""Does SPD beat plain decoding by the clock? Tokens/s on this machine, every figure from one run.

For each n, each bound choice (even, balanced, explicit) and each controller placement (--controllers: own_process =
n stage processes + the controller, first_stage = the controller runs stage 1, n processes; threads = cores //
processes): distributed SPD (the trained module whose n and bounds match, else an untrained one, labelled),
distributed pipeline-parallel AR over the same processes, with L′acc, seconds per step, the module's time per
step, the messages' time per step (a probe step: every message of a full step, no compute) and the calibrated
prediction (spd/eval/calibrate.py's cost model at the stage processes' thread count). Beside them: the
single-process AR of this suite and HF `generate`, both on all cores, and with --lookup transformers' prompt lookup
(`prompt_lookup_num_tokens`) and this suite's lookup chain (spd.drafters.lookup; τ = tokens per target forward),
with --local-spd SPD with the shipped n = 5 module in one process (runtime=local), with --eagle3 EAGLE-3's chain, each
also as draft trees for every --widths entry > 1. Each distributed SPD row is run
once per --draft-sources entry (module, lookup+module), with the acceptance of each source's drafts; with
--suffix-widths the priced context statistics (method=suffix) at each W, with rows per cycle and the share of cycles
its pricing left plain. Prompts (--sets): the first --limit of each eval set and/or the everyday set (30 held-out
ShareGPT first turns), chat template, --max-new-tokens each, stopping at EOS; greedy and T=1 (top-k 50, top-p 1.0).
Every greedy row is checked token for token against the suite's AR; every row's worst prompt against AR is kept.
The single-process rows (both temperatures) take turns on each prompt, so a drifting machine is shared by all of them.

    python -m bench.wallclock --checkpoint outputs/smollm2_n2_balanced/checkpoint --ns 1,2 --limit 20
    python -m bench.wallclock --sets everyday,eval --limit 10 --max-new-tokens 256 --lookup --suffix-widths 1,4 --ns ""
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import platform
import sys
import time

import torch

from spd.config import GenerateConfig, load_config
from spd.decoding import Request, eos_ids_of
from spd.engine import build_decoder, open_engine, pick_decoder
from spd.eval.output import write_json
from spd.drafters.lookup import LookupDrafter
from spd.methods import AR, CHAIN, PIPELINE, SUFFIX_MODULE
from spd.runtime.stages import open_stages
from spd.session import open_session
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.drafters.suffix import Retrieval, SuffixDrafter
from spd.corpora.retrieval import open_datastore
from spd.targets.row_costs import cached_row_costs
from bench.wallclock_sets import REPEAT_SPAN, prompt_set, summarise_set
from bench.wallclock_table import markdown
from bench.wallclock_distributed import distributed_rows
from bench.wallclock_turns import decode_interleaved, hf_run, params_for, seed_of
from bench.wallclock_variants import SuffixVariant, UnkeyedRequest

PLAIN = "float32-plain"      # --dtypes: the float32 target multiplying with F.linear (spd.targets.panel off)
REPEAT_KV = "float32-repeat-kv"   # --dtypes: the float32 target attending with transformers' SDPA as it is


def local_spd_decoders(args, stack: contextlib.ExitStack) -> dict[float, list[tuple[dict, object]]]:
    """SPD with the shipped n = 5 module, stages one after another in this process (runtime=local),
    once per --widths entry (W > 1: draft trees): {temperature: [(row fields, decoder)]}, the stages held open by
    `stack` while the field takes its turns."""
    built: dict[float, list] = {t: [] for t in args.temperatures}
    for width in args.widths:
        cfg = load_config(GenerateConfig, None, [f"target={args.target}", "method=spd", "runtime=local", f"W={width}"])
        session = open_session(cfg)
        stages = stack.enter_context(open_stages(session.staged, session.spec.runtime, session.drafter().layers_needed(
            session.staged.bounds), session.caches.cache_dir, width))
        for temperature in args.temperatures:
            decoder = build_decoder(PIPELINE, session.staged, session.eos_ids, session.drafter(), stages=stages,
                                    width=session.spec.tree.width)
            built[temperature].append(({"n": session.staged.n, "bounds": "even", "stage_bounds": session.staged.bounds,
                                        "module": "shipped", "checkpoint": session.spec.module.checkpoint, "method": "spd",
                                        "draft_source": "module", "W": width, "runtime": "local"}, decoder))
    return built


def eagle3_decoders(args) -> dict[float, list[tuple[dict, object, object]]]:
    """EAGLE-3's chain (W = 1) and dynamic tree (W > 1, --tree-nodes nodes) with the module at --eagle3; per
    --eagle3-sources, also beside the priced context statistics (draft_source=suffix+module, --suffix-length deep).
    {temperature: [(row fields, decoder, drafter)]}: one Session each, a drafter of its own per temperature (its
    tallies -- cycles, priced out, module consulted -- belong to one row)."""
    built: dict[float, list] = {t: [] for t in args.temperatures}
    for width, source in itertools.product(args.widths, args.eagle3_sources):
        deep = [f"draft_length={args.suffix_length}"] if source == SUFFIX_MODULE else []
        cfg = load_config(GenerateConfig, None, [f"target={args.target}", "method=eagle3", f"checkpoint={args.eagle3}",
                                                 f"W={width}", f"tree_nodes={args.tree_nodes}",
                                                 f"draft_source={source}", *deep])
        session = open_session(cfg)
        fields = {"method": "eagle3", "module": "trained", "checkpoint": args.eagle3, "W": width,
                  "draft_source": source, "draft_length": session.spec.draft_length,
                  "tree_nodes": session.spec.tree.nodes if width > 1 else None}
        for temperature in args.temperatures:
            drafter = session.drafter()
            decoder = pick_decoder("eagle3", cfg, session, None, drafter)   # the chain, or the tree at W > 1
            built[temperature].append((fields, decoder, drafter if source == SUFFIX_MODULE else None))
    return built


def single_process_rows(args, prompts, cores: int, loaded, others=()) -> list[dict]:
    """The single-process field at every temperature — the suite's AR, transformers `generate` (and its prompt
    lookup), the priced context statistics, the lookup chain, SPD in one process (--local-spd), EAGLE-3 (--eagle3) —
    timed taking turns on each prompt (decode_interleaved), so every row of a cell meets the same machine. `others`:
    (dtype name, the target loaded in it) whose AR, transformers and priced rows take their turns too (--dtypes)."""
    torch.set_num_threads(cores)
    eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
    lo, hi = args.lookup_ngrams
    rows, runs, drafters = [], [], []
    retrieval = [(spec, Retrieval(open_datastore(spec, loaded.tokenizer, loaded.model.config.vocab_size)))
                 for spec in args.datastore.split(",") if spec]
    eagle3 = eagle3_decoders(args) if args.eagle3 else {}
    stack = contextlib.ExitStack()
    spd = local_spd_decoders(args, stack) if args.local_spd else {}

    def add(row: dict, run, drafter=None, dtype: str = "float32") -> None:
        rows.append({"runtime": "single process", "threads_per_process": cores, "processes": 1, "dtype": dtype,
                     **row})   # SPD says runtime=local
        runs.append(run)
        drafters.append(drafter)

    def chain_run(decoder, params, keyed=True):
        request = Request if keyed else UnkeyedRequest
        return lambda key, ids: decoder.generate(ids, request(args.max_new_tokens, params, seed_of(key)))

    def twins(temperature) -> list[bool]:
        """[True] and, with --keyed-ab at T > 0, False: AR drawing from the generator instead of keyed draws, a
        method=suffix row blind to the noise (the same keyed draws, so the same text as its twin)"""
        return [True, False] if args.keyed_ab and temperature else [True]

    for dtype, target in [("float32", loaded), *others]:
        staged = StagedTarget(target.model, 1, plain_products=dtype == PLAIN, plain_attention=dtype == REPEAT_KV)
        put = functools.partial(add, dtype=dtype)
        for temperature in args.temperatures:
            params = params_for(temperature)

            pad = loaded.tokenizer.pad_token_id or 0
            hf = hf_run(target.model, pad, temperature, args.max_new_tokens)

            twin = dtype == REPEAT_KV     # one row changes with the attention kernel: the drafted (AR is one row)
            for keyed in [] if twin else twins(temperature):
                put({"method": "ar", "temperature": temperature, **({} if keyed else {"keyed": False})},
                    chain_run(build_decoder(AR, staged, eos), params, keyed))
            if not (args.skip_hf or twin):
                put({"method": "hf_generate", "temperature": temperature}, hf)
            if not args.lookup:
                continue
            if not (args.skip_hf or twin):
                put({"method": "hf_prompt_lookup", "temperature": temperature, "draft_length": args.hf_lookup_tokens},
                    hf_run(target.model, pad, temperature, args.max_new_tokens, args.hf_lookup_tokens))
            stores = ([] if args.skip_suffix_alone and retrieval else [(None, None)]) + retrieval
            priors = [False, True] if temperature and args.prior_ab else [False]
            recalls = [True, False] if temperature and args.recall_ab else [True]
            for width, (spec, store), by_noise, sampled_prior, recall in [
                    (w, s, k, p, r) for w in args.suffix_widths for s in stores for k in twins(temperature)
                    for p in priors for r in recalls]:
                # context statistics, priced with this machine's row costs; and with the datastore's candidates too
                budget = args.tree_nodes if width > 1 else args.suffix_length
                costs = cached_row_costs(staged, budget + 1)
                # what method=suffix builds (spd.drafters.suffix), or an A/B's variant of it
                options = dict(by_noise=by_noise, sampled_prior=sampled_prior, recall=recall)
                drafter = SuffixDrafter(1, hi, costs, retrieval=store) if options == SuffixVariant.DEFAULT else \
                    SuffixVariant(1, hi, costs, retrieval=store, **options)
                decoder = build_decoder(CHAIN, staged, eos, drafter, draft_length=args.suffix_length, width=width,
                                        tree_nodes=args.tree_nodes)
                put({"method": "suffix", "temperature": temperature, "draft_length": args.suffix_length, "W": width,
                     "tree_nodes": args.tree_nodes if width > 1 else None, "ngrams": [lo, hi],
                     "datastore": spec, **({} if by_noise else {"by_noise": False}),
                     **({"sampled_prior": True} if sampled_prior else {}),
                     **({} if recall else {"recall": False}),
                     "row_costs_s": list(costs.seconds)}, chain_run(decoder, params), drafter)
            if dtype != "float32":
                continue               # the lookup chain, SPD and EAGLE-3: float32 only
            for m in args.draft_length:
                decoder = build_decoder(CHAIN, staged, eos, LookupDrafter(lo, hi), draft_length=m)
                put({"method": "lookup", "temperature": temperature, "draft_length": m, "ngrams": [lo, hi]},
                    chain_run(decoder, params))
    for temperature in args.temperatures:      # SPD and EAGLE-3 take their turns too (own Sessions, built once)
        for fields, decoder in spd.get(temperature, []):
            add({**fields, "temperature": temperature}, chain_run(decoder, params_for(temperature)))
        for fields, decoder, drafter in eagle3.get(temperature, []):
            add({**fields, "temperature": temperature}, chain_run(decoder, params_for(temperature)), drafter)
    with stack:
        results = decode_interleaved(prompts, runs)
    for i, result in enumerate(results):
        rows[i].update(result)
        if rows[i]["method"] == "spd":
            rows[i].update(eal=rows[i]["n"] * result["alpha"], s_per_step=result["seconds"] / result["K"])
        if drafters[i] is not None:
            rows[i]["priced_out_share"] = drafters[i].priced_out / max(drafters[i].cycles, 1)
            if hasattr(drafters[i], "consulted"):      # cycles EAGLE-3's module drafted beside the statistics
                rows[i]["module_consulted_share"] = drafters[i].consulted / max(drafters[i].cycles, 1)
    return rows


def batched_rows(args, prompts, cores: int, loaded) -> list[dict]:
    """Every prompt submitted at once to a batched decoder of max_batch = b: plain AR and the lookup chain
    on the whole target (spd.runtime.batch), with --local-spd SPD's shipped n = 5 module in one pipeline under SEED's
    schedule (spd.runtime.seed), once per --draft-sources entry. tokens/s is the aggregate: all tokens over the wall
    time of the whole batch run."""
    from spd.engine import build_batch_decoder

    torch.set_num_threads(cores)
    eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
    staged = StagedTarget(loaded.model, 1)
    lo, hi = args.lookup_ngrams
    makers = {"ar": lambda b: build_batch_decoder(AR, staged, eos, max_batch=b),
              "lookup": lambda b: build_batch_decoder(CHAIN, staged, eos, lambda: LookupDrafter(lo, hi), max_batch=b,
                                                      draft_length=args.draft_length[0])}
    if args.local_spd:
        for source in args.draft_sources:
            cfg = load_config(GenerateConfig, None, [f"target={args.target}", "method=spd", f"draft_source={source}"])
            session = open_session(cfg)
            makers[f"spd/{source}"] = lambda b, s=session: build_batch_decoder(PIPELINE, s.staged, s.eos_ids,
                                                                               s.drafter, max_batch=b)
    engines = contextlib.ExitStack()
    threads = {}
    if args.distributed_spd:   # the stage processes hold every sequence (Setup.slots = the largest batch)
        for source in args.draft_sources:
            cfg = load_config(GenerateConfig, None, [f"target={args.target}", "method=spd", f"draft_source={source}",
                                                     f"n={args.distributed_spd}", "runtime=distributed",
                                                     f"max_batch={max(args.batch)}"])
            engine = engines.enter_context(open_engine(cfg))
            name = f"spd/{source}/distributed"
            makers[name] = lambda b, e=engine: e.batch_decoder(b)
            threads[name] = (torch.get_num_threads(), engine.stages.world)
    rows = []
    for b in args.batch:
        for temperature in args.temperatures:
            params = params_for(temperature)
            for name, make in makers.items():
                per_process, processes = threads.get(name, (cores, 1))
                torch.set_num_threads(per_process)
                decoder = make(b)
                start = time.perf_counter()
                tickets = {key: decoder.submit(ids, Request(args.max_new_tokens, params, seed_of(key)))
                           for key, ids in prompts}
                decoder.run()
                seconds = time.perf_counter() - start
                tokens = sum(len(t.tokens) for t in tickets.values())
                method, source, where = (name.split("/") + ["", ""])[:3]
                rows.append({"method": method, "draft_source": source or None,
                             "runtime": f"{where} batched".strip(), "max_batch": b, "processes": processes,
                             "threads_per_process": per_process, "temperature": temperature,
                             "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                             "outputs": {key: t.tokens for key, t in tickets.items()},
                             **({"draft_length": args.draft_length[0]} if method == "lookup" else {})})
                print(f"batched {name} max_batch={b} T={temperature:g}: {tokens / seconds:.1f} tokens/s",
                      file=sys.stderr)
    engines.close()
    torch.set_num_threads(cores)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--checkpoint", action="append", default=[], help="trained module(s); used where n and bounds match")
    ap.add_argument("--ns", default="1,2")
    ap.add_argument("--bounds", default="even,balanced",
                    help="even, balanced, or explicit inner bounds (19, 10/20), comma-separated")
    ap.add_argument("--limit", type=int, default=20, help="first prompts of each eval set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-pipeline-ar", action="store_true", help="no pipeline-parallel AR row over the stage processes")
    ap.add_argument("--draft-sources", default="module,lookup+module", help="distributed SPD rows, one per source")
    ap.add_argument("--controllers", default="first_stage,own_process",
                    help="where the controller runs: first_stage (n processes), own_process (n + 1)")
    ap.add_argument("--lookup", action="store_true", help="also transformers' prompt lookup and the lookup chain")
    ap.add_argument("--draft-length", default="7", help="the lookup chain's drafts per cycle (one row per value)")
    ap.add_argument("--hf-lookup-tokens", type=int, default=8, help="transformers' prompt_lookup_num_tokens")
    ap.add_argument("--lookup-ngrams", default="2,8", help="the lookup chain's shortest,longest suffix match")
    ap.add_argument("--local-spd", action="store_true", help="also SPD with the shipped n = 5 module, runtime=local")
    ap.add_argument("--eagle3", help="also EAGLE-3 with this trained module (the chain, and trees per --widths)")
    ap.add_argument("--eagle3-sources", default="module",
                    help="--eagle3 rows per draft source: module, suffix+module (beside the context statistics)")
    ap.add_argument("--widths", default="1", help="draft-tree widths W for --local-spd and --eagle3 rows")
    ap.add_argument("--tree-nodes", type=int, default=16, help="EAGLE-3's drafted nodes per verification at W > 1")
    ap.add_argument("--batch", default="", help="e.g. 1,2,4,8: batched rows at these max_batch")
    ap.add_argument("--distributed-spd", type=int, default=0,
                    help="with --batch: also SPD's pipeline of this n in stage processes under SEED's schedule")
    ap.add_argument("--suffix-widths", default="", help="e.g. 1,4: method=suffix rows (priced) at these W")
    ap.add_argument("--suffix-length", type=int, default=15, help="method=suffix's depth bound m")
    ap.add_argument("--datastore", default="", help="e.g. sharegpt,answers+sharegpt: each method=suffix row also "
                    "with each of these datastores")
    ap.add_argument("--skip-suffix-alone", action="store_true", help="with --datastore: no method=suffix row "
                    "without one")
    ap.add_argument("--keyed-ab", action="store_true", help="at T > 0 also the suite's AR drawing from the request's "
                    "generator instead of keyed draws, and each method=suffix row blind to the noise (A/Bs in one run)")
    ap.add_argument("--prior-ab", action="store_true", help="at T > 0 also each method=suffix row with "
                    "spd.pricing.AcceptancePredictor.for_sampling's prior instead of the greedy one (an A/B in "
                    "one run)")
    ap.add_argument("--recall-ab", action="store_true", help="at T > 0 also each method=suffix row without the "
                    "recall of the target's p at the context's occurrences (an A/B in one run)")
    ap.add_argument("--sets", default="eval", help="eval (the first --limit of each eval set) and/or everyday (the "
                    "30 held-out ShareGPT first turns, answers to EOS or --max-new-tokens)")
    ap.add_argument("--everyday-limit", type=int, default=30)
    ap.add_argument("--dtypes", default="float32", help="e.g. float32,bfloat16: the AR, transformers and method=suffix "
                    "rows in each (the target loaded once per dtype; the lookup chain, SPD and EAGLE-3 in float32); "
                    f"{PLAIN}: float32 with F.linear's products instead of spd.targets.panel's; {REPEAT_KV}: float32 "
                    "attending with transformers' SDPA (K/V repeated per query head) instead of spd.targets.gqa_attention, "
                    "its method=suffix rows only")
    ap.add_argument("--out", default="docs/results/wallclock.json")
    args = ap.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.lookup_ngrams = tuple(int(x) for x in args.lookup_ngrams.split(","))
    args.draft_sources = args.draft_sources.split(",")
    args.draft_length = [int(m) for m in args.draft_length.split(",") if m]
    args.widths = [int(w) for w in args.widths.split(",")]
    args.eagle3_sources = [s for s in args.eagle3_sources.split(",") if s]
    args.batch = [int(b) for b in args.batch.split(",") if b]
    args.suffix_widths = [int(w) for w in args.suffix_widths.split(",") if w]
    if (args.suffix_widths or args.datastore) and not args.lookup:
        # they take their turns among --lookup's rows: without it they would be dropped after an hour's run
        print("wallclock.py: error: --suffix-widths and --datastore rows run with --lookup; add --lookup (and "
              "--draft-length \"\" --skip-hf for no lookup chain or transformers rows)", file=sys.stderr)
        return 2
    loaded = load_target(args.target)
    args.others = [(name, load_target(args.target, dtype=torch.float32 if name in (PLAIN, REPEAT_KV) else
                                      getattr(torch, name))) for name in args.dtypes.split(",") if name and name != "float32"]
    rows, sets = [], {}
    for name in args.sets.split(","):
        prompts = prompt_set(name, args, loaded.tokenizer)
        before = len(rows)
        rows += set_rows(args, prompts, loaded)
        for row in rows[before:]:
            row["set"] = name
        sets[name] = summarise_set(rows[before:], prompts, args)
    report = {"rows": rows, "sets": sets, "max_new_tokens": args.max_new_tokens, "cores": args.cores,
              "prompts": sum(s["prompts"] for s in sets.values()),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
              "command": " ".join(["python", *sys.argv])}
    write_json(args.out, report)
    print(markdown(report))
    for name, summary in sets.items():
        if summary["repeat_share"] is not None:         # measured on AR's greedy output
            print(f"{name}: {summary['prompts']} prompts, {summary['repeat_share']:.1%} of AR's greedy positions "
                  f"inside a repeated {REPEAT_SPAN}-token span")
    return 0


def set_rows(args, prompts, loaded) -> list[dict]:
    rows = single_process_rows(args, prompts, args.cores, loaded, args.others)
    if args.batch:
        rows += batched_rows(args, prompts, args.cores, loaded)
    for n in [int(x) for x in args.ns.split(",") if x]:          # --ns "": single-process rows only
        kinds = args.bounds.split(",") if n > 1 else ["even"]  # one stage: nothing to balance
        controllers = [c for c in args.controllers.split(",") if n > 1 or c == "own_process"]
        for kind, controller in itertools.product(kinds, controllers):
            rows += distributed_rows(args, prompts, n, kind, args.cores, loaded.model, controller)
    return rows


if __name__ == "__main__":
    sys.exit(main())
