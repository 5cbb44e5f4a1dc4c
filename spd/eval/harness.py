"""`spd-infer eval`: the paper's protocol on MT-Bench, GSM8K and HumanEval (first turn, chat template, greedy or
T=1/top-k 50/top-p 1.0, a fixed seed per prompt), per-sample JSONL, pooled summaries, report, W&B.

Greedy runs use the exact fast evaluator by default: the target's greedy trace (cached) plus batched module passes
give every N and K the step-by-step runtime would (bench/fast_eval_check.py proves it on the eval prompts; EAGLE-3's
chain and tree and the lookup chain have theirs, `spd.eval.fast_chain`, checked the same way; SPD's pipeline trees,
W > 1, run step by step: their branches' states are not in a greedy trace); `exact_trace=true` runs the runtime
itself, and then plain AR as well, checking every sample token for token.
"""

from __future__ import annotations

import platform
import subprocess
import time
import zlib

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from spd.engine import Engine, open_engine
from spd.errors import UserError
from spd.paths import check_writable_dir
from spd.eval.calibrate import (calibrate, calibrate_chain, chain_measured_cost_speedup, formula_speedup,
                                measured_cost_speedup, rows_calibration, rows_measured_cost_speedup)
from spd.eval.output import EvalOutput, check_output_dir, write_json
from spd.eval.summary import METHOD_NAMES, summarise
from spd.eval.traces import TraceCache
from spd.methods import DRAFTING_METHODS, LOOKUP_MODULE, METHODS, SEGMENTS, behaviour
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.runtimes import eager_reference, runtime
from spd.session import Session, asks, open_session
from spd.spec import DecodeSpec


def validate(cfg) -> None:
    if DecodeSpec.of(cfg).method not in (None, *DRAFTING_METHODS):
        raise UserError("method=ar drafts nothing to evaluate; eval runs a drafter (spd, ppsd, spd_output_state, "
                        "eagle3, lookup) and plain AR beside it (ar_baseline=true)")
    unknown = [ds for ds in cfg.datasets if ds not in DATASETS]
    if unknown or not cfg.datasets:
        raise UserError(f"unknown dataset {', '.join(map(repr, unknown)) or '(none given)'}; choose from "
                        f"{', '.join(DATASETS)}")


def uses_fast_evaluator(cfg) -> bool:
    """Greedy, in-process, eager runs are scored from cached traces; the others run the step-by-step runtime (and
    so do Self-Draft's branches beside the suffix drafter: a trace holds no branch row's logits)."""
    spec = DecodeSpec.of(cfg)
    evaluable = spec.method is None or METHODS[spec.method].fast_eval   # None: a checkpoint's module
    evaluable = evaluable and not spec.suffix.branches
    return evaluable and spec.sampling.temperature == 0 and not cfg.exact_trace and eager_reference(spec.runtime) and (
        spec.tree.width == 1 or spec.method is not None and METHODS[spec.method].replays_trees)


def prompt_seed(seed: int, dataset: str, question_id) -> int:
    """A fixed seed per prompt, independent of which other prompts run or in what order."""
    return zlib.crc32(f"{seed}/{dataset}/{question_id}".encode())


def fast_sample(session: Session, cfg, traces: TraceCache, dataset: str, question_id, prompt_ids) -> dict:
    trace, info = traces.get(dataset, question_id, prompt_ids)
    start = time.perf_counter()
    spec, tree = session.spec, session.spec.tree
    evaluator = METHODS[spec.method].fast_evaluator
    offered = dict(module=session.module, make_drafter=session.drafter, draft_source=spec.draft_source,
                   ngrams=(spec.lookup.min_ngram, spec.lookup.max_ngram), draft_length=spec.draft_length,
                   width=tree.width, tree_nodes=tree.nodes, source_pricing=spec.lookup.source_pricing,
                   n=session.staged.n, segment=tree.segment, children=tree.children,
                   vocab=session.loaded.model.config.vocab_size)
    # each evaluator names what it replays with, as a drafter factory does (spd.session.asks)
    result = behaviour(evaluator)(trace, **{name: offered[name] for name in asks(evaluator) if name != "trace"})
    seconds = time.perf_counter() - start
    stats = result["stats"]
    return {"mode": "fast", "token_ids": trace.tokens, **stats.as_dict(), "ar_match": None,
            "wall_s": seconds, "tokens_per_s": None,
            "ar_tokens_per_s": len(trace.tokens) / info["seconds"] if info["recorded_now"] else None,
            "min_target_margin": result["min_target_margin"]}


def runtime_sample(engine: Engine, seed: int, prompt_ids) -> dict:
    spd = engine.decoder.generate(prompt_ids, engine.request(seed=seed))
    record = {"mode": "runtime", "token_ids": spd.token_ids, **spd.stats.as_dict(), "ar_match": None,
              "wall_s": spd.seconds, "tokens_per_s": spd.tokens_per_s, "ar_tokens_per_s": None}
    if engine.cfg.ar_baseline:
        ar = engine.baseline.generate(prompt_ids, engine.request(seed=seed))
        record["ar_tokens_per_s"] = ar.tokens_per_s
        if engine.session.params.greedy:  # lossless: greedy SPD must be the target's own greedy decode
            record["ar_match"] = ar.token_ids == spd.token_ids
    return record


def batched_samples(engine: Engine, batched, cfg, items: list):
    """The step-by-step samples of `items` ((dataset, question, prompt ids)), batch_size prompts at a time through
    the engine's batched decoder, and their plain AR references batched the same way; yields each sample's record
    in order. Their time is shared with the batch, so no tokens/s is reported (latency is measured one at a time)."""
    baseline = engine.batch_decoder(cfg.batch_size, "ar") if cfg.ar_baseline else None
    for lo in range(0, len(items), cfg.batch_size):
        chunk = items[lo: lo + cfg.batch_size]
        seeds = [prompt_seed(engine.session.spec.sampling.seed, ds, q["question_id"]) for ds, q, _ in chunk]
        tickets = [batched.submit(ids, engine.request(seed=seed)) for (_, _, ids), seed in zip(chunk, seeds)]
        references = [baseline.submit(ids, engine.request(seed=seed)) for (_, _, ids), seed in zip(chunk, seeds)] \
            if baseline else []
        with torch.no_grad():
            batched.run()
            if baseline:
                baseline.run()
        for i, ticket in enumerate(tickets):
            record = {"mode": "runtime", "token_ids": ticket.tokens, **ticket.stats.as_dict(), "ar_match": None,
                      "wall_s": ticket.seconds, "tokens_per_s": None, "ar_tokens_per_s": None,
                      "batch_size": cfg.batch_size}
            if baseline and engine.session.params.greedy:
                record["ar_match"] = references[i].tokens == ticket.tokens
            yield record


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=__file__.rsplit("/", 3)[0])
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, {platform.node()}"




def context_of(tok, work, samples: list[dict]) -> list[int]:
    """The first prompt of the run and its decode (re-tokenised from the sample's text): the real context FlowSpec's
    tree growth is timed on."""
    ds, q = work[0]
    text = next(s["text"] for s in samples if s["dataset"] == ds and str(s["question_id"]) == str(q["question_id"]))
    return chat_prompt_ids(tok, q["turns"][0]) + tok.encode(text, add_special_tokens=False)


def module_layers(module) -> int:
    if module is None:
        return 0                                                     # the context lookup: no model drafts
    return len(module.layers) if hasattr(module, "layers") else 1   # EAGLE-3: one layer


def run_label(session: Session, cfg) -> str:
    spec = session.spec
    suffix = "" if spec.module.checkpoint or session.module is None else ", untrained"
    if METHODS[spec.method].chain:
        tree = f", W={spec.tree.width}, {spec.tree.nodes} nodes" if spec.tree.width > 1 else ""
        return f"{METHOD_NAMES[spec.method]} (m={spec.draft_length}{tree}{suffix})"
    lookup = ", lookup+module" if spec.draft_source == LOOKUP_MODULE else ""
    return f"{METHOD_NAMES[spec.method]} (n={session.staged.n}, L_s={module_layers(session.module)}{suffix}{lookup})"


def run_eval(cfg, log=print) -> dict:
    validate(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    check_output_dir(cfg.output_dir, resolved, cfg.resume)
    if uses_fast_evaluator(cfg):
        check_writable_dir(cfg.trace_cache_dir, "trace_cache_dir")
    session = open_session(cfg)
    tok = session.loaded.tokenizer
    if tok is None:
        raise UserError(f"target {session.loaded.name!r} has no tokenizer; eval needs its chat template")
    outside = [l for l in cfg.trace_layers if not 0 <= l <= session.staged.num_layers]
    if outside:
        raise UserError(f"trace_layers has {outside}, outside this target's hidden states "
                        f"0..{session.staged.num_layers}; drop them")
    out = EvalOutput(cfg.output_dir, resolved)
    work = [(ds, q) for ds in cfg.datasets for q in load_questions(ds)[: cfg.limit]]
    done = out.done()
    todo = [(ds, q) for ds, q in work if (ds, str(q["question_id"])) not in done]
    fast = uses_fast_evaluator(cfg)
    capture = session.drafter().layers_needed(session.staged.bounds)
    # a pipelined module's traces hold every layer its layout's features read (one directory per layout serves all
    # plans); a chain, or a method without a module, reads what it asks for (FlowSpec, PipeDec: nothing)
    spec, tree = session.spec, session.spec.tree
    read = capture if METHODS[spec.method].chain or not METHODS[spec.method].trained else None
    traces = TraceCache(cfg.trace_cache_dir, session.loaded, session.staged, spec.max_new_tokens, read,
                        list(cfg.trace_layers)) if fast else None
    L_s = module_layers(session.module)
    log(f"{len(work)} prompts, {len(work) - len(todo)} already done; "
        f"{'fast evaluator (greedy)' if fast else 'step-by-step runtime'}")
    if fast and cfg.batch_size > 1:
        items = [(ds, q["question_id"], chat_prompt_ids(tok, q["turns"][0])) for ds, q in todo]
        with tqdm(total=sum(not traces.has(ds, qid) for ds, qid, _ in items), desc="traces", unit="prompt") as bar:
            traces.record_missing(items, cfg.batch_size, bar.update)
    with open_engine(cfg, session=session) as engine:
        batched = None if fast or cfg.batch_size == 1 else engine.batch_decoder(cfg.batch_size)
        records = batched_samples(engine, batched, cfg, [(ds, q, chat_prompt_ids(tok, q["turns"][0])) for ds, q in todo]) \
            if batched is not None else None
        for ds, q in tqdm(todo, desc="eval", unit="prompt", disable=False):  # explicit: the CLI mutes other bars
            ids = chat_prompt_ids(tok, q["turns"][0])
            seed = prompt_seed(spec.sampling.seed, ds, q["question_id"])
            with torch.no_grad():
                if records is not None:
                    rec = next(records)
                else:
                    rec = fast_sample(session, cfg, traces, ds, q["question_id"], ids) if fast else \
                        runtime_sample(engine, seed, ids)
            token_ids = rec.pop("token_ids")
            out.append({"question_id": q["question_id"], "dataset": ds, "method": spec.method, "L_s": L_s,
                        "T": spec.sampling.temperature, "top_k": session.params.top_k,
                        "top_p": session.params.top_p, "seed": seed, "runtime": spec.runtime.name, **rec,
                        "text": tok.decode(token_ids, skip_special_tokens=True)})
    selected = {(ds, str(q["question_id"])) for ds, q in work}
    samples = [s for s in out.samples if (s["dataset"], str(s["question_id"])) in selected]
    summary = summarise(samples, list(cfg.datasets))
    # Calibration times every stage (EAGLE-3: every part of a cycle) in this process; under runtime=distributed it
    # holds none (the clock is measured). EAGLE-3 needs no pipeline, so the clock also judges it directly.
    calibration = None
    chain = METHODS[spec.method].chain
    if cfg.calibrate and runtime(spec.runtime.name).reference and METHODS[spec.method].rows_vary and samples:
        calibration = rows_calibration(session, summary["overall"]["step_rows"], context_of(tok, work, samples))
    elif cfg.calibrate and runtime(spec.runtime.name).reference and session.module is not None:  # the lookup has no module to time
        calibration = calibrate_chain(session.staged, session.drafter(), session.params, spec.draft_length,
                                      width=tree.width, budget=tree.nodes) if chain else \
            calibrate(session.staged, session.module, session.params, width=tree.width)
    summary["speedup"] = speedups(summary, session.staged, session.module, calibration) if not chain else \
        chain_speedups(summary, session.staged.num_layers, spec.draft_length, calibration, L_s)
    summary["run"] = {"method": spec.method, "label": run_label(session, cfg), "n": session.staged.n, "module_layers": L_s,
                      "temperature": spec.sampling.temperature, "top_k": session.params.top_k,
                      "top_p": session.params.top_p, "W": tree.width,
                      "tree_nodes": tree.nodes if chain and tree.width > 1 else None,
                      "draft_length": spec.draft_length if chain else None,
                      "max_new_tokens": spec.max_new_tokens, "checkpoint": spec.module.checkpoint,
                      "target": session.loaded.name, "mode": "fast" if fast else "runtime",
                      "runtime": spec.runtime.name, "stage_bounds": session.staged.bounds,
                      "draft_source": spec.draft_source if METHODS[spec.method].pipelined else None,
                      "segment": tree.segment if METHODS[spec.method].decoder == SEGMENTS else None,
                      "children": tree.children, "draft_layers": session.draft_model.layers
                      if session.draft_model is not None else None}
    summary["meta"] = {"config": resolved, "git_commit": git_commit(), "machine": machine(session.staged.device),
                       "dtype": spec.runtime.dtype, "seed": spec.sampling.seed, "torch": torch.__version__,
                       "created": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json(f"{cfg.output_dir}/summary.json", summary)
    from spd.eval.report import write_report

    write_report([summary], cfg.output_dir)
    log_wandb(cfg, resolved, summary)
    return summary


def speedups(summary: dict, staged, module, calibration: dict | None) -> dict:
    groups = {**summary["datasets"], "overall": summary["overall"]}
    # PipeDec's draft model runs beside the stages like SPD's module: no module adds to a step's layers
    cost = (staged.n, False, staged.num_layers, 0) if module is None else \
        (staged.n, module.plan.after_step, staged.num_layers, len(module.layers))
    formula = {k: formula_speedup(v["alpha_pooled"], *cost) for k, v in groups.items() if v.get("alpha_pooled")}
    measured = None
    if calibration and calibration.get("rows_priced"):      # FlowSpec, PipeDec: each step priced by its rows
        measured = {k: rows_measured_cost_speedup(v["alpha_pooled"], v["step_rows"], calibration)
                    for k, v in groups.items() if v.get("alpha_pooled")}
    elif calibration:
        measured = {k: measured_cost_speedup(v["alpha_pooled"], calibration) for k, v in groups.items()
                    if v.get("alpha_pooled")}
    return {"formula": formula, "measured_cost": measured, "calibration": calibration}


def chain_speedups(summary: dict, num_layers: int, m: int, calibration: dict | None = None,
                   module_layers: int = 1) -> dict:
    """A chain: S = tau * L / (L_s * m + L) (design §3; the lookup's L_s is 0), tau by the measured cycle cost, and
    the clock: tokens/s against AR in the same run."""
    groups = {**summary["datasets"], "overall": summary["overall"]}
    formula = {k: v["tau_pooled"] * num_layers / (module_layers * m + num_layers) for k, v in groups.items()
               if v.get("tau_pooled")}
    measured = {k: chain_measured_cost_speedup(v["tau_pooled"], calibration) for k, v in groups.items()
                if v.get("tau_pooled")} if calibration else None
    clock = {k: v["tokens_per_s"] / v["ar_tokens_per_s"] for k, v in groups.items()
             if v.get("tokens_per_s") and v.get("ar_tokens_per_s")}
    return {"formula": formula, "measured_cost": measured, "wall_clock": clock or None, "calibration": calibration}


def log_wandb(cfg, resolved: dict, summary: dict) -> None:
    """One W&B run per eval (offline by default): L'acc per dataset as metrics and summary, plus the table."""
    if cfg.wandb.mode == "disabled":
        return
    import wandb

    run = wandb.init(mode=cfg.wandb.mode, project=cfg.wandb.project, dir=cfg.output_dir, config=resolved,
                     settings=wandb.Settings(silent=True),
                     name=cfg.wandb.name or summary["run"]["label"], job_type="eval",
                     tags=[f"n={summary['run']['n']}", f"T={summary['run']['temperature']:g}"])
    metrics = {}
    for ds, figures in {**summary["datasets"], "overall": summary["overall"]}.items():
        for key in ("eal_pooled", "eal_mean_of_ratios", "alpha_pooled", "rollbacks", "N", "K", "tau_pooled", "cycles"):
            metrics[f"eval/{ds}/{key}"] = figures.get(key)
        for source, counts in figures.get("sources", {}).items():
            metrics[f"eval/{ds}/acceptance/{source}"] = counts["acceptance"]
    for kind in ("formula", "measured_cost", "wall_clock"):
        for ds, value in (summary["speedup"].get(kind) or {}).items():
            metrics[f"speedup/{kind}/{ds}"] = value
    metrics = {k: v for k, v in metrics.items() if v is not None}
    run.log(metrics)
    rows = [[ds, f["samples"], f.get("eal_pooled"), f.get("tau_pooled"), f.get("alpha_pooled"),
             (summary["speedup"]["measured_cost"] or {}).get(ds)] for ds, f in summary["datasets"].items()]
    run.log({"eval/table": wandb.Table(columns=["dataset", "samples", "eal_pooled", "tau_pooled",
                                                "alpha_pooled", "measured_cost_speedup"], data=rows)})
    run.summary.update(metrics)
    run.finish()
