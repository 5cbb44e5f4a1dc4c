"""The trainer stopped from outside and started again: SIGTERM (what the deepspeed launcher sends its trainers on
Ctrl-C) saves a resumable state like Ctrl-C, and an output_dir that cannot be resumed is refused before anything
loads, naming the key that does work."""

import json
import os
import runpy
import signal
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from launch import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(ROOT, "configs", "train", "debug.yaml")
DATA = os.path.join(ROOT, "data", "debug_conversations.jsonl")
ENV = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
STEPS = 40   # long enough (about 0.1 s a step here) to be stopped in the middle, short enough to resume quickly


def train_cmd(out, *overrides):
    """The debug run, 4 micro-batches a step (the signal mostly lands inside a step), saved only when stopped."""
    return [sys.executable, os.path.join(ROOT, "train", "run.py"), "--config", DEBUG, f"output_dir={out}",
            f"data.path={DATA}", "wandb.mode=disabled", f"optim.steps={STEPS}", "save_every=0",
            "deepspeed.batch_size=8", "deepspeed.accumulation=4", *overrides]


def test_deepspeed_launchers_signal_is_read_as_ctrl_c():
    """deepspeed.launcher.launch answers Ctrl-C by terminating each trainer (SIGTERM), then kills it 30 s later:
    the signal the trainer must save on."""
    import inspect

    from deepspeed.launcher import launch

    source = inspect.getsource(launch.terminate_process_tree)
    assert "terminate()" in source and "timeout=30" in source
    from spd.train.loop import STOP_SIGNALS

    assert signal.SIGTERM in STOP_SIGNALS and signal.SIGINT in STOP_SIGNALS


@pytest.mark.slow
def test_sigterm_saves_a_resumable_state_and_resume_finishes_the_run_exactly(tmp_path):
    stopped, full = tmp_path / "stopped", tmp_path / "full"
    uninterrupted = subprocess.Popen(train_cmd(full), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
                                     cwd=ROOT)
    proc = subprocess.Popen(train_cmd(stopped), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)
    metrics = stopped / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:   # a step or two trained
            break
        time.sleep(0.01)
    assert proc.poll() is None, "training ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "train/run.py: interrupted"
    done = len(metrics.read_text().splitlines())       # whole steps: a step cut short is neither logged nor saved
    assert 2 <= done < STEPS
    assert (stopped / "ds_state" / "latest").read_text().strip() == f"step{done}"
    assert f"saved step {done} in {stopped / 'ds_state'}; resume=true continues it" in out
    assert json.loads((stopped / "checkpoint" / "config.json").read_text())["step"] == done

    resumed = run_python(train_cmd(stopped, "resume=true")[1:], env=ENV, cwd=ROOT, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed at step {done}" in resumed.stdout + resumed.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, STEPS + 1))
    assert uninterrupted.wait(timeout=240) == 0
    a = load_file(os.path.join(full, "checkpoint", "model.safetensors"))
    b = load_file(os.path.join(stopped, "checkpoint", "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


# -- output_dir: refused from the config alone ----------------------------------------------------------------------

def run_in_process(monkeypatch, capsys, out, *overrides):
    """train/run.py's main() here, with the trainer's loop (torch's models, DeepSpeed, the data) made unimportable:
    a refusal that needed any of it would fail with ImportError instead of exit code 2."""
    monkeypatch.setitem(sys.modules, "spd.train.loop", None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    main = runpy.run_path(os.path.join(ROOT, "train", "run.py"), run_name="train_run")["main"]
    code = main(["--config", DEBUG, f"output_dir={out}", f"data.path={DATA}", "wandb.mode=disabled", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def write_run(out, *overrides, saved: int | None = None):
    """A run's folder as the trainer leaves it: config.json of this config, and a DeepSpeed state at step `saved`
    (None: it stopped before its first save)."""
    from spd.config import load_config
    from spd.train.config import TrainConfig

    cfg = load_config(TrainConfig, DEBUG, [f"output_dir={out}", f"data.path={DATA}", "wandb.mode=disabled",
                                           *overrides])
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(OmegaConf.to_container(cfg, resolve=True)))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    if saved is not None:
        (out / "ds_state" / f"step{saved}").mkdir(parents=True)
        (out / "ds_state" / "latest").write_text(f"step{saved}")


def test_a_run_that_saved_nothing_is_refused_at_once_with_overwrite(monkeypatch, capsys, tmp_path):
    out = tmp_path / "run"
    write_run(out)
    code, line = run_in_process(monkeypatch, capsys, out)
    assert code == 2 and "saved no resumable state" in line and "pass overwrite=true" in line
    assert "resume=true" not in line                       # never the circle: resume=true cannot work here
    code, line = run_in_process(monkeypatch, capsys, out, "resume=true")
    assert code == 2 and "holds no resumable state" in line and "pass overwrite=true instead of resume=true" in line


def test_a_run_with_a_saved_state_is_offered_resume(monkeypatch, capsys, tmp_path):
    out = tmp_path / "run"
    write_run(out, saved=7)
    code, line = run_in_process(monkeypatch, capsys, out)
    assert code == 2 and "saved at step 7" in line and "pass resume=true" in line
    code, line = run_in_process(monkeypatch, capsys, out, "resume=true", "optim.steps=3")
    assert code == 2 and "different config" in line
    # a `latest` naming a state that is not there (a save cut off) is no state
    (out / "ds_state" / "step7").rmdir()
    code, line = run_in_process(monkeypatch, capsys, out, "resume=true")
    assert code == 2 and "holds no resumable state" in line


def test_someone_elses_files_are_never_offered_to_overwrite(monkeypatch, capsys, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("someone's files")
    for extra in ([], ["overwrite=true"]):
        code, line = run_in_process(monkeypatch, capsys, out, *extra)
        assert code == 2 and "holds no training run" in line and "overwrite" not in line, extra
    assert (out / "notes.txt").exists()
    code, line = run_in_process(monkeypatch, capsys, out, "resume=true")
    assert code == 2 and "holds no run (no config.json)" in line
