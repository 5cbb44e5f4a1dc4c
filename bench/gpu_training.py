"""The train step of a GPU run (bench/gpu_session.py): a short probe measures tokens/s, the run's steps (and so its
linear lr decay) are planned to fill the box, the trainer runs with a checkpoint about every minute, each exported at
once as float16 parts for the trip home, and SIGINT 25 s before the box ends makes it finish its step and save.
Stdlib only, like bench/gpu_session.py: it runs before the wheels are installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DRY_TRAIN_S = 20               # the dry run's training box (probe, plan, train, SIGINT, export)


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


class Training:
    """The GPU run's training methods (for gpu_session.GpuRun): they read its plan, work directory, log, session record
    and run_process."""

    def train_keys(self, name: str) -> list[str]:
        keys = [f"data.path={self.plan['data']}", f"model.target={self.plan['target']}", "wandb.mode=disabled",
                "overwrite=true"] + ([f"model.n={name[1:]}"] if name[1:].isdigit() else [])   # n2, n5; eagle3
        continued = (self.plan.get("continue") or {}).get(name)
        if continued:
            keys.append(f"init_from={continued}")
        if self.dry:
            keys += ["model.draft_vocab=0", "deepspeed.batch_size=2", "deepspeed.micro_batch=2",
                     "data.max_length=256", "data.heldout=2", "eval_decodes=1", "eval_new_tokens=8",
                     "model.stage_bounds=null"]   # the tiny target's 10 layers: even stages
        return keys

    def train(self, name: str, box: float) -> dict:
        """Probe, plan, train until the box ends (SIGINT: the trainer saves), exporting every checkpoint."""
        continued = (self.plan.get("continue") or {}).get(name)
        record = self.session["steps"][f"train_{name}"] = {"status": "running", "box_s": box, "continues": continued}
        started = time.time()
        deadline = started + box
        # n = 5 continues a trained module's distillation (its own recipe, a new lr cycle); the others start afresh
        config = os.path.join(REPO, "configs", "train", f"gpu_{name}{'_continue' if continued else ''}.yaml")
        run_py = os.path.join(REPO, "train", "run.py")
        probe_dir = os.path.join(self.work, f"probe_{name}")
        probe_steps = 4 if self.dry else self.args.probe_steps
        rc, probe_s = self.run_process([sys.executable, run_py, "--config", config, *self.train_keys(name),
                                        f"output_dir={probe_dir}", f"optim.steps={probe_steps}",
                                        "data.max_conversations=64" if self.dry else "data.max_conversations=512",
                                        "eval_decodes=0", "save_every=0"],
                                       # the dry run's box is short; a fresh machine's first DeepSpeed start builds
                                       # an op first (~20 s), so its probe may take longer and the box starts after
                                       300 if self.dry else deadline - time.time())
        if self.dry:
            deadline = max(deadline, time.time() + DRY_TRAIN_S / 2)
        metrics = read_metrics(os.path.join(probe_dir, "metrics.jsonl"))
        if rc != 0 or len(metrics) < 3:
            record.update(status="failed", why=f"the probe run ended with {rc} after {len(metrics)} steps",
                          probe_s=probe_s)
            self.save()
            return record
        steady = metrics[1:]
        tps = sorted(m["tokens_per_s"] for m in steady)[len(steady) // 2]
        per_step = (metrics[-1]["train/tokens_seen"] - metrics[0]["train/tokens_seen"]) / (len(metrics) - 1)
        startup_s = probe_s - sum(per_step / m["tokens_per_s"] for m in metrics)
        left = deadline - time.time() - 1.5 * startup_s - 25 - 10
        steps = max(2, int(left * tps / per_step))
        if self.dry:        # far more steps than the box holds: the dry run's box always ends the run by SIGINT
            steps = max(steps, 10**5)
        save_every = max(1, int(60 * tps / per_step)) if not self.dry else 2
        record.update(probe={"steps": len(metrics), "tokens_per_s": tps, "tokens_per_step": per_step,
                             "startup_s": startup_s, "seconds": probe_s},
                      planned_steps=steps, planned_tokens=int(steps * per_step), save_every=save_every)
        self.log(f"train {name}: probe {tps:.0f} tokens/s, {per_step:.0f} tokens/step -> {steps} steps "
                 f"(~{steps * per_step / 1e6:.2f}M tokens), a checkpoint every {save_every} steps")
        self.save()
        out_dir = os.path.join(self.work, f"train_{name}")
        argv = [sys.executable, run_py, "--config", config, *self.train_keys(name), f"output_dir={out_dir}",
                f"optim.steps={steps}", f"save_every={save_every}"]
        self.log(f"train {name}: {' '.join(argv[1:])}")
        record["command"] = " ".join(["python", *[os.path.relpath(a, REPO) if a.startswith(REPO) else a
                                                  for a in argv[1:]]])
        with open(self.log_path, "a") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            exported, stopped = None, None
            while proc.poll() is None:
                # the dry run stops only a run that has saved once: its box is too short to be sure of reaching the
                # loop, and SIGINT during start-up would kill it without the save this path is there to check
                # SIGINT 25 s before the box ends: the step in flight, the save and the last export fit inside it
                stop_at = deadline - (0 if self.dry else 25)
                due = time.time() > stop_at and (not self.dry or exported is not None or time.time() > stop_at + 60)
                if due and stopped is None:
                    proc.send_signal(signal.SIGINT)          # finish the step, save, exit 130
                    stopped = time.time()
                    self.log(f"train {name}: the box ended, SIGINT sent")
                if stopped is not None and time.time() > stopped + (15 if self.dry else 30):
                    proc.kill()
                    self.log(f"train {name}: killed, no exit after SIGINT")
                exported = self.export_if_new(name, out_dir, exported)
                time.sleep(1 if self.dry else 5)
            rc = proc.wait()
        self.export_if_new(name, out_dir, exported)
        metrics = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
        record.update(rc=rc, seconds=time.time() - started, steps_done=len(metrics), stopped_by_box=stopped is not None,
                      last=metrics[-1] if metrics else None,
                      curve=[{k: m.get(k) for k in ("step", "train/loss", "train/top1", "tokens_per_s",
                                                     "train/tokens_seen")} for m in metrics[:: max(1, len(metrics) // 40)]],
                      status="ok" if name in self.session["modules"] else "failed")
        self.save()
        return record

    def export_if_new(self, name: str, out_dir: str, exported):
        config = os.path.join(out_dir, "checkpoint", "config.json")
        if not os.path.isfile(config) or os.path.getmtime(config) == exported:
            return exported
        stamp = os.path.getmtime(config)
        result = os.path.join(self.work, f"export_{name}.json")
        rc, _ = self.run_process([sys.executable, "-m", "bench.gpu_steps", "export", "--plan",
                                  self.plan_path, "--checkpoint", os.path.join(out_dir, "checkpoint"), "--name", name,
                                  "--result", result], 120)
        if rc == 0:
            with open(result) as f:
                self.session["modules"][name] = json.load(f)
            self.save()
        return stamp
