"""The steps of a GPU run (bench/gpu_session.py runs each in its own process, under its own time box).

    python -m bench.gpu_steps env|correctness|speed|eval --plan PLAN.json --deadline EPOCH --result OUT.json
    python -m bench.gpu_steps export --plan PLAN.json --checkpoint DIR --name n5 --result OUT.json
    python -m bench.gpu_steps tiny --plan PLAN.json           # the dry run's random target, saved as an HF directory

Each step writes its JSON result after every row, atomically, so a step killed at its deadline still leaves what it
finished. A row that raises records its traceback and the step goes on with the next row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback

import torch

from bench.gpu import top2 as gpu_top2
from bench.gpu_training import read_metrics
from spd.config import GenerateConfig, load_config
from spd.decoding import Request
from spd.engine import build_decoder
from spd.eval.output import write_json
from spd.methods import AR, CHAIN, PIPELINE
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.runtime.stages import reference_kind, stage_executor
from spd.verify.sampling import SamplingParams
from spd.session import open_session
from spd.targets.stages import StagedTarget

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_k=50)
MIB = 2**20
SHARD_BYTES = 16 * MIB - 4096   # the runner returns files of at most 16 MiB
ROWS_FILE = "rows.jsonl"        # in $OUT: every row of every step, appended as it ends


class Result:
    """A step's JSON, rewritten after every change, and each row appended to `rows` (the run's $OUT/rows.jsonl) the
    moment it ends: the step's JSON reaches $OUT only when the step ends, and a command killed by its limit or the
    machine's lease returns only what $OUT holds."""

    def __init__(self, path: str, step: str, rows: str | None = None):
        self.path, self.rows, self.data = path, rows, {"step": step, "rows": []}

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        self.save()
        self.ended(row["name"], row)

    def ended(self, name: str, row: dict, **where) -> None:
        if self.rows:
            append_row(self.rows, {"step": self.data["step"], **where, "name": name, "row": row})

    def save(self) -> None:
        write_json(self.path, self.data)


def append_row(path: str, record: dict) -> None:
    """One JSON line, written whole and flushed to disk: a kill leaves every earlier line intact."""
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: str) -> list[dict]:
    """rows.jsonl's records; a line cut by a kill is left out."""
    return read_metrics(path)


def guarded(result: Result, name: str, deadline: float, fn) -> None:
    """One row: skipped past the deadline, its traceback recorded if it raises."""
    if time.time() > deadline:
        result.add({"name": name, "status": "skipped", "why": "the step's time box ran out"})
        return
    start = time.perf_counter()
    try:
        row = fn()
        row.update(name=name, status=row.get("status", "ok"), seconds=time.perf_counter() - start)
    except Exception:
        row = {"name": name, "status": "error", "traceback": traceback.format_exc(),
               "seconds": time.perf_counter() - start}
    result.add(row)
    print(f"[{result.data['step']}] {name}: {row['status']} ({row['seconds']:.1f} s)"
          + (f" {row.get('summary', '')}" if row.get("summary") else ""), flush=True)


def _share_loaded_targets() -> None:
    """One load of the target per dtype in a step: rows differ in method, module and executor, never in weights
    (frozen), and a load costs seconds a row would otherwise pay."""
    import functools

    import spd.session

    spd.session.load_target = functools.lru_cache(maxsize=2)(spd.session.load_target)


def session_for(plan: dict, dtype: str, overrides: list[str]):
    keys = [f"target={plan['target']}", f"device={plan['device']}", f"dtype={dtype}", *overrides]
    return open_session(load_config(GenerateConfig, None, keys))


def prompts_of(tokenizer, per_set: int) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, q["turns"][0]) for ds in DATASETS for q in load_questions(ds)[:per_set]]


# --- env -----------------------------------------------------------------------------------------------------

def step_env(plan: dict, deadline: float, result: Result) -> None:
    import platform
    from importlib.metadata import version

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
            "cuda_available": torch.cuda.is_available()}
    for name in ("transformers", "tokenizers", "safetensors", "deepspeed", "datasets", "omegaconf", "gguf"):
        try:
            info[name] = version(name)
        except Exception as exc:
            info[name] = f"missing: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count)
    result.data["env"] = info

    def warm_target():
        from spd.targets.loading import load_target

        start = time.perf_counter()
        loaded = load_target(plan["target"], torch.float32, "cpu")   # converts the GGUF into the weight cache once
        return {"summary": loaded.name, "load_s": time.perf_counter() - start, "target": loaded.name,
                "fingerprint": loaded.fingerprint}
    guarded(result, "target_weight_cache", deadline, warm_target)


# --- correctness ---------------------------------------------------------------------------------------------

# row name -> spd.runtime.stages executor kind
PIPELINE_EXECUTORS = {"local_eager": "local", "local_graphs": "graphs", "streams_eager": "streams",
                      "streams_graphs": "streams_graphs"}


def correctness_rows(plan: dict) -> list[tuple[str, list[str], str | None, int]]:
    """(row name, config keys, pipeline executor or None for a chain, W), what has never run on a GPU first:
    eager rows cost ~30 ms a target forward there (Python-bound), so the last ones may not fit the box, and eager
    greedy SPD = AR at W = 1 is the one row an earlier GPU run already checked (docs/results.md, "On a GPU")."""
    spd = ["method=spd", f"checkpoint={plan['spd_checkpoint']}"]
    eagle3 = f"checkpoint={plan.get('eagle3_checkpoint') or 'random'}"     # the shipped head where it travelled
    order = [("streams_graphs", 1), ("local_graphs", 1), ("streams_eager", 1), ("streams_graphs", 4),
             ("local_graphs", 4), ("streams_eager", 4), ("local_eager", 4)]
    rows = [(f"spd_{kind}_w{w}", spd + [f"W={w}"], kind, w) for kind, w in order]
    rows += [("eagle3_tree_w4", ["method=eagle3", eagle3, "W=4"], None, 4),
             ("eagle3_chain", ["method=eagle3", eagle3], None, 1),
             ("lookup_chain", ["method=lookup"], None, 1),
             ("ppsd_local_eager_w1", ["method=ppsd", "checkpoint=random"], "local_eager", 1),
             ("spd_local_eager_w1", spd + ["W=1"], "local_eager", 1)]
    only = asked(plan)
    return [row for row in rows if only is None or row[0] in only]


def asked(plan: dict) -> frozenset[str] | None:
    """The rows a run names (gpu_session.py --rows: what earlier runs left unmeasured); None: every row."""
    return frozenset(plan["rows"]) if plan.get("rows") is not None else None


def near_tie(margin: float, top: float, dtype: str) -> bool:
    """Within 8 roundings of the top logit in this dtype: two kernels that sum in another order may flip it."""
    return margin <= 8 * torch.finfo(getattr(torch, dtype)).eps * max(1.0, abs(top))


def decode_row(plan: dict, dtype: str, keys: list[str], executor: str | None, width: int) -> dict:
    cfg = plan["correctness"]
    session = session_for(plan, dtype, keys)
    eos = session.eos_ids
    drafter = session.drafter()
    whole = StagedTarget(session.loaded.model, 1)
    if executor is None:        # a chain: the target verifies whole; AR eager is its reference
        decoder = build_decoder(CHAIN, session.staged, eos, drafter, width=session.spec.tree.width,
                                draft_length=session.spec.draft_length, tree_nodes=session.spec.tree.nodes)
        reference = build_decoder(AR, whole, eos)
    else:
        stages = stage_executor(PIPELINE_EXECUTORS[executor], session.staged)
        decoder = build_decoder(PIPELINE, session.staged, eos, drafter, stages=stages, width=width)
        ref_kind = reference_kind(PIPELINE_EXECUTORS[executor])
        reference = build_decoder(AR, whole, eos, stages=ref_kind and stage_executor(ref_kind, whole))
    prompts = prompts_of(session.loaded.tokenizer, 1)[: cfg["prompts"]]
    max_new = cfg["max_new_tokens"]
    equal, diverged, tokens, rollbacks, sampled = 0, [], 0, 0, []
    for i, ids in enumerate(prompts):
        out = decoder.generate(ids, Request(max_new, GREEDY))
        ref = reference.generate(ids, Request(max_new, GREEDY)).token_ids
        tokens += len(out.token_ids)
        rollbacks += getattr(out.stats, "rollbacks", 0) or 0
        if out.token_ids == ref:
            equal += 1
        else:
            at = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), min(len(ref), len(out.token_ids)))
            margin, top = gpu_top2(whole, ids + ref[:at]) if at < len(ref) else (None, None)
            diverged.append({"prompt": i, "position": at, "decoded": out.token_ids[at: at + 3], "ar": ref[at: at + 3],
                             "ar_top2_margin": margin, "near_tie": margin is not None and near_tie(margin, top, dtype)})
        t1 = decoder.generate(ids, Request(max_new, SAMPLED, seed=i))
        sampled.append(len(t1.token_ids))
    summary = f"greedy = AR {equal}/{len(prompts)}, T=1 ran {len(sampled)}"
    return {"dtype": dtype, "W": width, "prompts": len(prompts), "greedy_equal": equal, "diverged": diverged,
            "tokens": tokens, "rollbacks": rollbacks, "sampled_tokens": sampled, "summary": summary,
            "status": "ok" if equal == len(prompts) else "mismatch"}


def step_correctness(plan: dict, deadline: float, result: Result) -> None:
    _share_loaded_targets()
    for name, keys, executor, width in correctness_rows(plan):
        for dtype in plan["dtypes"]:
            guarded(result, f"{name}_{dtype}", deadline,
                    lambda keys=keys, executor=executor, width=width, dtype=dtype:
                    decode_row(plan, dtype, keys, executor, width))


# --- speed ---------------------------------------------------------------------------------------------------

def step_speed(plan: dict, deadline: float, result: Result) -> None:
    """bench/gpu.py's rows in bench/gpu_rows.py's order, each saved (and appended to $OUT) the moment it ends; rows an
    earlier call measured (plan["resume"]: its session.json or rows.jsonl) are kept, not run again, and their greedy
    outputs are the verdicts' references. What comes before the first row (the session, the prompts, the copy
    bandwidth) raising is the step's error (main)."""
    from bench import gpu, gpu_rows
    from spd.models.checkpoint import load_checkpoint

    _share_loaded_targets()
    cfg = plan["speed"]
    device = torch.device(plan["device"])
    earlier = resumed_runs(plan.get("resume"))
    result.data["resumed_from"] = plan.get("resume")
    result.data["copy_bandwidth_bytes_per_s"] = gpu.copy_bandwidth(device, mib=cfg.get("copy_mib", 512))
    for dtype in cfg["dtypes"]:
        session = session_for(plan, dtype, ["method=spd", f"checkpoint={plan['spd_checkpoint']}"])
        prompts = prompts_of(session.loaded.tokenizer, cfg["prompts_per_set"])
        weight_bytes = sum(p.numel() * p.element_size() for p in session.loaded.model.parameters())
        roofline = result.data["copy_bandwidth_bytes_per_s"] / weight_bytes
        run = {"weight_bytes": weight_bytes, "roofline_tokens_per_s": roofline, "n": session.staged.n,
               "checkpoint": session.spec.module.checkpoint, "prompts": len(prompts), "max_new_tokens": cfg["max_new_tokens"],
               "eagle3_checkpoint": plan.get("eagle3_checkpoint") or "untrained",
               "rows": dict(earlier.get(dtype, {}).get("rows", {}))}
        result.data.setdefault("runs", {})[dtype] = run
        rows = run["rows"]

        def saved():
            for row in rows.values():
                if "tokens_per_s" in row:
                    row["fraction_of_roofline"] = row["tokens_per_s"] / roofline
            result.save()

        def ended(name, row, dtype=dtype):
            if row.get("skipped") == "not asked":
                return                          # no result: a later call that asks for it runs it
            result.ended(name, row, dtype=dtype)
            status = "resumed" if row.get("resumed") else "error" if "error" in row else \
                f"skipped ({row['skipped']})" if "skipped" in row else f"{row['tokens_per_s']:.1f} tokens/s"
            print(f"[speed] {dtype} {name}: {status}", flush=True)
        whole = StagedTarget(session.loaded.model, 1)
        eagle3 = plan.get("eagle3_checkpoint")
        specs, executors = gpu_rows.speed_specs(
            session, cfg["max_new_tokens"], device, getattr(torch, dtype),
            eagle3=(lambda: load_checkpoint(eagle3, whole, session.loaded)) if eagle3 else None,
            hybrid_shape=cfg.get("hybrid_shape"))
        gpu_rows.run_speed(specs, prompts, cfg["max_new_tokens"], device, rows, saved, deadline, asked(plan),
                           cfg["compile"], lambda ids: gpu.top2(whole, ids)[0], {}, ended)
        if "stage_overlap" not in run:
            guarded_extra(run, "stage_overlap", deadline, lambda: gpu.stage_overlap(
                executors["spd_streams_graphs"](), session.staged, prompts[0], device, gpu.capture_of(session)))
            result.save()
        print(f"[speed] {dtype}: roofline {roofline:.0f} tok/s; " + ", ".join(
            f"{k} {v['tokens_per_s']:.1f}" for k, v in rows.items() if "tokens_per_s" in v), flush=True)


def guarded_extra(run: dict, key: str, deadline: float, fn) -> None:
    """A measurement beside the rows: skipped past the deadline, its error recorded in its place."""
    if time.time() > deadline:
        run[key] = {"skipped": "time box"}
        return
    try:
        run[key] = fn()
    except Exception as e:
        run[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-4000:]}


def resumed_runs(path: str | None) -> dict:
    """The speed rows an earlier call left ({dtype: {"rows": {name: row}}}): from its session.json
    (steps.speed.runs), or from its rows.jsonl (the rows that reached $OUT before a kill), or none."""
    if not path:
        return {}
    if path.endswith(".jsonl"):
        runs = {}
        for record in read_rows(path):
            if record.get("step") == "speed":
                runs.setdefault(record.get("dtype"), {"rows": {}})["rows"][record["name"]] = record["row"]
        return runs
    with open(path) as f:
        session = json.load(f)
    return (session.get("steps", {}).get("speed") or {}).get("runs", {})


# --- eval ----------------------------------------------------------------------------------------------------

def step_eval(plan: dict, deadline: float, result: Result) -> None:
    from spd.eval.config import EvalConfig
    from spd.eval.harness import run_eval

    cfg = plan["eval"]
    for label, checkpoint in cfg["modules"].items():
        def one(label=label, checkpoint=checkpoint):
            keys = [f"target={plan['target']}", f"checkpoint={checkpoint}", f"method={method_of(checkpoint)}",
                    f"limit={cfg['limit']}",
                    f"max_new_tokens={cfg['max_new_tokens']}", f"device={plan['device']}", "dtype=float32",
                    "calibrate=false", f"output_dir={os.path.join(plan['work'], 'eval', plan['stamp'], label)}", "resume=false",
                    f"trace_cache_dir={os.path.join(plan['work'], 'traces')}", "wandb.mode=disabled"]
            summary = run_eval(load_config(EvalConfig, None, keys), log=lambda m: print(f"[eval] {m}", flush=True))
            # SPD's modules: L'acc; EAGLE-3's chain: tau, tokens per target forward (spd.eval.summary)
            metric = "eal_pooled" if "eal_pooled" in summary["overall"] else "tau_pooled"
            pooled = summary["overall"][metric]
            return {"label": label, "checkpoint": checkpoint, "metric": metric, metric: pooled,
                    metric.replace("_pooled", "_per_dataset"): {name: ds[metric] for name, ds in summary["datasets"].items()},
                    "samples": summary["overall"]["samples"], "limit": cfg["limit"],
                    "max_new_tokens": cfg["max_new_tokens"],
                    "summary": f"{NAMES[metric]} {pooled:.3f}"}
        guarded(result, f"eval_{label}", deadline, one)


NAMES = {"eal_pooled": "L'acc", "tau_pooled": "tau"}


def method_of(checkpoint: str) -> str:
    """The method a module directory was trained as (its config.json), so the eval decodes it as such."""
    path = os.path.join(checkpoint, "config.json")
    if checkpoint == "random" or not os.path.isfile(path):
        return "spd"
    with open(path) as f:
        return json.load(f).get("method", "spd")


# --- export: a checkpoint in float16, cut into files the runner returns --------------------------------

def step_export(plan: dict, checkpoint: str, name: str, result: Result) -> None:
    from safetensors.torch import load_file, save_file

    from spd.models.checkpoint import float16_state

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    state = float16_state(load_file(os.path.join(checkpoint, "model.safetensors")))
    out = plan["out"]
    tmp = os.path.join(plan["work"], f"{name}.fp16.safetensors")
    save_file(state, tmp, metadata={"format": config.get("format", "spd-speculation-module")})
    with open(tmp, "rb") as f:
        blob = f.read()
    shards = []
    for k in range(0, len(blob), SHARD_BYTES):
        shard = f"{name}.safetensors.part{k // SHARD_BYTES + 1}"
        with open(os.path.join(out, shard + ".tmp"), "wb") as g:
            g.write(blob[k: k + SHARD_BYTES])
        os.replace(os.path.join(out, shard + ".tmp"), os.path.join(out, shard))
        shards.append(shard)
    result.data.update(name=name, config=config, shards=shards, sha256=hashlib.sha256(blob).hexdigest(),
                       bytes=len(blob))
    result.save()
    print(f"[export] {name}: step {config.get('step')}, {config.get('train_tokens')} tokens -> {len(shards)} files",
          flush=True)


def step_tiny(plan: dict) -> None:
    """The dry run's random target, and an untrained n = 5 module for it in the shape the continued training asks
    for (its stand-in for the shipped module)."""
    from spd.models.checkpoint import save_checkpoint
    from spd.models.module import SpeculationModule
    from spd.targets.loading import load_target
    from spd.targets.stages import StagedTarget
    from spd.targets.tiny import save_tiny_target

    save_tiny_target(plan["target"], "llama", seed=0)
    loaded = load_target(plan["target"])
    module = SpeculationModule.from_target(StagedTarget(loaded.model, 5), 1, seed=0, feature_norm="standard",
                                           fc_bias=True)
    save_checkpoint(module, loaded, plan["continue"]["n5"], {"step": 0, "train_tokens": 0})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_steps")
    ap.add_argument("step", choices=["env", "correctness", "speed", "eval", "export", "tiny"])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--deadline", type=float, default=float("inf"))
    ap.add_argument("--result")
    ap.add_argument("--checkpoint")
    ap.add_argument("--name")
    args = ap.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    if args.step == "tiny":
        step_tiny(plan)
        return 0
    result = Result(args.result, args.step, os.path.join(plan["out"], ROWS_FILE) if plan.get("out") else None)
    if args.step == "export":
        step_export(plan, args.checkpoint, args.name, result)
        return 0
    try:
        {"env": step_env, "correctness": step_correctness, "speed": step_speed, "eval": step_eval}[args.step](
            plan, args.deadline, result)
    except Exception as e:      # outside every row's guard (the session, the prompts): the step's own error
        result.data.update(error=f"{type(e).__name__}: {str(e)[:500]}", traceback=traceback.format_exc()[-4000:])
        result.save()
        print(f"[{args.step}] failed before its rows: {result.data['error']}", flush=True)
        return 1
    result.data["finished"] = True
    result.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
