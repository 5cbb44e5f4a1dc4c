"""Every entry point survives bad input: one stderr line `<command>: error: ...` naming the problem and the fix,
exit code 2, no traceback, and the file system exactly as it was (nothing written for a refused run).

The case tables here are what docs/serving.md counts per entry point ("Bad input, per entry point")."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed

from spd.models.checkpoint import save_checkpoint
from spd.cli import main as spd_infer
from spd.models.module import SpeculationModule
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

from helpers import load_train_main, snapshot
from launch import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(ROOT, "configs", "train", "debug.yaml")
DATA = os.path.join(ROOT, "data", "debug_conversations.jsonl")
ENV = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


train_main = load_train_main()


def refused(capsys, command: str, argv: list[str], needle: str, root) -> None:
    """Run one entry point in-process and check the whole contract."""
    before = snapshot(root)
    launcher_env = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                         "MASTER_PORT")}
    code = spd_infer(argv) if command == "spd-infer" else train_main(argv)
    # nothing of a refused run stays in this process: a process group or torchrun's variables left behind would make
    # every later pipeline in it think it runs under torchrun
    assert not torch.distributed.is_initialized()
    assert {key: os.environ.get(key) for key in launcher_env} == launcher_env
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"{command}: error:"), err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err
    assert snapshot(root) == before, "a refused run wrote files"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A scratch directory that is also the working directory: everything a run could write lands under it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "invalid.yaml").write_text("n: [1,\nmax_new_tokens: 4\n")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "list.yaml").write_text("- n\n- 5\n")
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "lines.jsonl").write_text('{"text": "one"}\n["two"]\n')
    return tmp_path


CONFIG_FILES = [("invalid.yaml", "not valid YAML"), ("binary.yaml", "not text"), ("list.yaml", "not a mapping"),
                ("missing.yaml", "does not exist"), (".", "not a file")]
ENTRY = {
    "generate": ("spd-infer", lambda t: ["generate", f"target={t}", "Hi", "max_new_tokens=4"]),
    "eval": ("spd-infer", lambda t: ["eval", f"target={t}", "limit=1", "output_dir=out"]),
    "train": ("train/run.py", lambda t: ["output_dir=out", f"data.path={DATA}", "model.target=tiny-llama"]),
}


@pytest.mark.parametrize("entry", sorted(ENTRY))
@pytest.mark.parametrize("name,needle", CONFIG_FILES)
def test_config_files(capsys, work, tiny_target_dir, entry, name, needle):
    command, base = ENTRY[entry]
    argv = base(tiny_target_dir)
    argv = [argv[0], "--config", name, *argv[1:]] if command == "spd-infer" else ["--config", name, *argv]
    refused(capsys, command, argv, needle, work)


VALUES = {
    "generate": [("temperature=nan", "temperature=nan is not a finite number"), ("temperature=inf", "not a finite"),
                 ("seed=123456789012345678901", "out of range"), ("device=tpu", "not a device"),
                 ("top_k=-1", "top_k=-1"), ("method=beam", "method='beam'"), ("runtime=cloud", "runtime='cloud'"),
                 ("dtype=int8", "dtype='int8'"), ("n=[1,", "not valid YAML"), ("timeout_s=0", "timeout_s=0"),
                 ("master_port=70000", "master_port=70000"), ("stage_bounds=even", "stage_bounds"),
                 ("runtime=streams", "runtime=streams runs each stage on a CUDA stream"),
                 ("cuda_graphs=true", "cuda_graphs=true replays CUDA graphs"),
                 ("method=lookup datastore=sharegpt", "datastore= is read by method=suffix"),
                 ("method=suffix datastore=nowhere.safetensors", "neither 'sharegpt', 'answers', a datastore file nor"),
                 ("method=suffix datastore=empty.txt", "holds no text"),
                 ("method=suffix datastore=lines.jsonl", "line 2 is not a JSON object"),
                 ("method=suffix datastore=a_file", "is not a datastore file"),
                 ("method=suffix datastore=answers", "no answers of a target with this tokenizer"),
                 ("method=suffix datastore=sharegpt+sharegpt", "join distinct datastores")],
    "eval": [("wandb.mode=sometimes", "wandb.mode='sometimes'"), ("temperature=nan", "not a finite"),
             ("limit=0", "limit=0"), ("datasets=[alpaca]", "unknown dataset"), ("seed=-1", "seed=-1"),
             ("max_new_tokens=1e999", "max_new_tokens"), ("runtime=streams", "device=cpu has none"),
             ("cuda_graphs=true", "cuda_graphs=true replays CUDA graphs"), ("trace_layers=[99]", "trace_layers")],
    "train": [("optim.lr=-1", "optim.lr=-1.0 must be a positive"), ("optim.steps=0", "optim.steps=0"),
              ("wandb.mode=sometimes", "wandb.mode='sometimes'"), ("deepspeed.precision=fp8", "deepspeed.precision"),
              ("optim.lr=nan", "not a finite"), ("seed=99999999999999999999", "out of range"),
              ("p_full=1.5", "p_full=1.5"), ("optim.betas=[0.9]", "optim.betas"), ("deepspeed.zero_stage=7", "zero_stage"),
              ("resume=true overwrite=true", "contradict"), ("model.init_fc=magic", "init_fc"),
              ("teacher_cache_dtype=int4", "teacher_cache_dtype"), ("model.feature_norm=layer", "feature_norm"),
              ("model.init_attention=previous", "needs model.fc_bias=true"),
              ("model.init_attention=sideways", "init_attention"),
              ("model.n=2 model.stage_bounds=[18]", "model.stage_bounds=[18] must be")],
}


@pytest.mark.parametrize("entry,value,needle", [(e, v, n) for e, cases in VALUES.items() for v, n in cases])
def test_values_that_make_no_sense(capsys, work, tiny_target_dir, entry, value, needle):
    command, base = ENTRY[entry]
    refused(capsys, command, base(tiny_target_dir) + value.split(), needle, work)


@pytest.fixture(scope="module")
def checkpoint(tiny_target_dir, tmp_path_factory):
    loaded = load_target(tiny_target_dir)
    module = SpeculationModule.from_target(StagedTarget(loaded.model, 5), 1, seed=3)
    path = str(tmp_path_factory.mktemp("ckpt") / "module")
    save_checkpoint(module, loaded, path)
    return path


def test_paths(capsys, work, tiny_target_dir, checkpoint):
    t = f"target={tiny_target_dir}"
    eval_base = ["eval", t, "limit=1"]
    refused(capsys, "spd-infer", [*eval_base, "output_dir=a_file"], "is a file", work)
    refused(capsys, "spd-infer", [*eval_base, "output_dir=a_file/sub"], "cannot be created", work)
    refused(capsys, "spd-infer", [*eval_base, "output_dir=out", "trace_cache_dir=a_file"], "trace_cache_dir", work)
    torn = work / "torn"
    torn.mkdir()
    (torn / "config.json").write_text('{"target": "tin')
    refused(capsys, "spd-infer", [*eval_base, "output_dir=torn"], "half-written", work)
    refused(capsys, "train/run.py", ["--config", DEBUG, "output_dir=a_file", f"data.path={DATA}"], "is a file", work)
    refused(capsys, "train/run.py", ["--config", DEBUG, "output_dir=out", f"data.path={DATA}", "teacher_cache=true",
                                     "teacher_cache_dir=a_file/x"], "teacher_cache_dir", work)
    # a checkpoint whose config.json lacks keys
    partial = work / "partial_ckpt"
    shutil.copytree(checkpoint, partial)
    config = json.loads((partial / "config.json").read_text())
    del config["stage_bounds"], config["target"]["fingerprint"]
    (partial / "config.json").write_text(json.dumps(config))
    refused(capsys, "spd-infer", ["generate", t, "Hi", f"checkpoint={partial}"], "lacks stage_bounds, "
            "target.fingerprint", work)
    # a checkpoint for another target is named as such even when n or the bounds would not fit either
    other = work / "other_target"
    from spd.targets.tiny import save_tiny_target

    save_tiny_target(str(other), seed=1)
    refused(capsys, "spd-infer", ["generate", f"target={other}", "Hi", f"checkpoint={checkpoint}", "n=3",
                                  "stage_bounds=[1, 2]"], "was trained for target", work)


def test_report_refuses_same_label_of_different_targets(capsys, work):
    run = {"run": {"label": "SPD (n=5, L_s=1)", "temperature": 0.0, "W": 1, "target": "SmolLM2-135M-Instruct",
                   "n": 5, "module_layers": 1},
           "datasets": {"gsm8k": {"eal_pooled": 1.2, "samples": 1}}, "overall": {"eal_pooled": 1.2}}
    for name, target in (("a", "SmolLM2-135M-Instruct"), ("b", "tiny_target0")):
        (work / name).mkdir()
        (work / name / "summary.json").write_text(json.dumps({**run, "run": {**run["run"], "target": target}}))
    refused(capsys, "spd-infer", ["report", "a", "b"], "evaluate different targets", work)
    refused(capsys, "spd-infer", ["report", "a", "--out", "a_file"], "--out='a_file' is a file", work)


def test_trainer_refuses_a_non_empty_output_dir(capsys, work):
    (work / "out").mkdir()
    (work / "out" / "notes.txt").write_text("someone's files")
    refused(capsys, "train/run.py", ["--config", DEBUG, "output_dir=out", f"data.path={DATA}"],
            "not empty and holds no training run", work)   # never offered to overwrite=true: they are not a run's


def test_malformed_jsonl_names_the_line(work):
    bad = work / "bad.jsonl"
    bad.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n{"conversations": [\n')
    proc = run_python([os.path.join(ROOT, "train", "run.py"), "--config", DEBUG, "output_dir=out", f"data.path={bad}",
                       "wandb.mode=disabled"], env=ENV, cwd=work, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "line 2: not JSON" in lines[-1] and lines[-1].startswith("train/run.py: error:")
    assert not (work / "out").exists()


def test_trainer_ctrl_c_resume_and_metrics(tmp_path):
    """Ctrl-C: the step finishes, a resumable state is saved, one line, exit 130; resume=true finishes the run and
    metrics.jsonl holds every step exactly once; overwrite=true starts afresh."""
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train", "run.py"), "--config", DEBUG, f"output_dir={out}",
           f"data.path={DATA}", "wandb.mode=disabled", "save_every=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "train/run.py: interrupted"
    stopped = len(metrics.read_text().splitlines())
    assert 3 <= stopped < 20
    assert (out / "ds_state" / "latest").read_text().strip() == f"step{stopped}"
    with open(metrics, "a") as f:  # as if the run had got further than its last checkpoint
        f.write(json.dumps({"step": stopped + 1, "train/loss": 0.0}) + "\n")
    done = run_python(cmd[1:] + ["resume=true"], env=ENV, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 21))
    again = run_python(cmd[1:] + ["overwrite=true", "optim.steps=2"], env=ENV, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("temperature,top_k,top_p", [(-1.0, 0, 1.0), (1.0, -2, 1.0), (1.0, 0, 1.5)])
def test_a_library_spec_and_a_config_are_refused_by_the_same_sampling_rule(temperature, top_k, top_p):
    """A DecodeSpec a library caller builds skips spd.config; its sampling settings meet the config's rule, word for
    word."""
    from spd.config import GenerateConfig, load_config
    from spd.errors import UserError
    from spd.session import sampling_params
    from spd.spec import Sampling

    with pytest.raises(UserError) as from_config:
        load_config(GenerateConfig, None, [f"temperature={temperature}", f"top_k={top_k}", f"top_p={top_p}"])
    with pytest.raises(UserError) as from_spec:
        sampling_params(Sampling(temperature, top_k, top_p, None))
    assert str(from_config.value) == str(from_spec.value)
    assert len(str(from_spec.value).splitlines()) == 1
