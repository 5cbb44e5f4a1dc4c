"""The distillation trainer on a tiny random target: learns, resumes exactly, and rejects bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from spd.errors import UserError
from launch import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(ROOT, "configs", "train", "debug.yaml")
DATA = os.path.join(ROOT, "data", "debug_conversations.jsonl")
ENV = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def train_cmd(out, *overrides):
    return [sys.executable, os.path.join(ROOT, "train", "run.py"), "--config", DEBUG, f"output_dir={out}",
            f"data.path={DATA}", "wandb.mode=disabled", *overrides]


def run_train(out, *overrides, check=True):
    proc = run_python(train_cmd(out, *overrides)[1:], env=ENV, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def weights(out):
    return load_file(os.path.join(out, "checkpoint", "model.safetensors"))


@pytest.mark.parametrize("method", ["spd", "ppsd", "spd_output_state", "eagle3"])
def test_debug_training_learns(tmp_path, method):
    from spd.models.module import SpeculationModule
    from spd.targets.loading import load_target
    from spd.targets.stages import StagedTarget
    from spd.train.data import load_conversations, tokenize_conversations
    from spd.models.eagle3 import Eagle3Module
    from spd.train.objective import collate, kd_loss, teacher_pass, ttt_loss

    out = tmp_path / "run"
    run_train(out, "wandb.mode=offline", f"method={method}")
    ckpt = json.loads((out / "checkpoint" / "config.json").read_text())
    assert ckpt["n"] == (1 if method == "eagle3" else 3) and ckpt["training"]["steps"] == 20
    assert ckpt["method"] == method
    # W&B offline run directory exists and the resolved config sits next to the outputs
    assert any(d.startswith("offline-run") for d in os.listdir(out / "wandb"))
    assert json.loads((out / "config.json").read_text())["model"]["n"] == 3
    # top-1 agreement of the trained module vs an untrained one, on training conversations
    loaded = load_target("tiny-llama")
    staged = StagedTarget(loaded.model, 3)
    convs = load_conversations(DATA, 8)
    batch = collate(tokenize_conversations(loaded.tokenizer, convs, 256, log=lambda m: None), 0)
    teacher = teacher_pass(staged, batch, None)
    occ = torch.tensor([1, 2, 3, 3, 1, 2, 3, 3])
    if method == "eagle3":   # every unrolled step of the training-time test, weighted as in training
        untrained = Eagle3Module.from_target(staged, seed=0)
        trained = Eagle3Module.from_target(staged, seed=0)
        teacher = teacher_pass(staged, batch, None, untrained.layers_needed())

        def scored(module):
            loss, agreement = ttt_loss(module(teacher.hidden, batch["valid"]), teacher)
            return loss, agreement[0]
    else:
        untrained = SpeculationModule.from_target(staged, 1, seed=0, method=method)
        trained = SpeculationModule.from_target(staged, 1, seed=0, method=method)

        def scored(module):
            return kd_loss(module(teacher.hidden, occ, batch["valid"]), teacher)
    trained.load_state_dict(weights(out))
    with torch.no_grad():
        loss0, top0 = scored(untrained)
        loss1, top1 = scored(trained)
    # EAGLE-3's loss sums 7 unrolled steps, the later ones predicting up to 8 tokens ahead of a random tiny target
    assert loss1 < (0.6 if method == "eagle3" else 0.5) * loss0
    assert top1.mean() > top0.mean() + 0.3


def test_resume_after_sigkill_matches_uninterrupted(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    run_train(full, "save_every=5")
    proc = subprocess.Popen(train_cmd(killed, "save_every=5"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=ENV, cwd=ROOT, text=True)
    deadline = time.time() + 240
    ds_dir = killed / "ds_state"
    # kill once a mid-run DeepSpeed state exists (step 5 or 10), before the run ends
    while time.time() < deadline:
        latest = ds_dir / "latest"
        if latest.exists() and latest.read_text().strip() in ("step5", "step10"):
            break
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_train(killed, "save_every=5", "resume=true")
    a, b = weights(full), weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


BAD = [
    (["deepspeed.batch_size=5"], "batch_size"),
    (["model.colour=3"], "unknown config key"),
    (["data.path=/nonexistent.jsonl"], "does not exist"),
    (["resume=true"], "holds no run"),
    (["occupancy_weights=[1.0,0.0]"], "occupancy_weights"),
]


@pytest.mark.parametrize("overrides,needle", BAD)
def test_bad_input(tmp_path, overrides, needle):
    proc = run_train(tmp_path / "bad", *overrides, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in lines[-1] and "Traceback" not in proc.stderr


def test_bad_data_files(tmp_path):
    from spd.train.data import load_conversations, tokenize_conversations
    from spd.targets.tiny import tiny_tokenizer

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"text": "no turns here"}\n')
    for path in (empty, junk):
        with pytest.raises(UserError):
            load_conversations(str(path), 10)
    tok = tiny_tokenizer()
    with pytest.raises(UserError, match="no assistant tokens"):
        tokenize_conversations(_NoAssistantTemplate(tok),
                               [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]],
                               256, log=lambda m: None)


class _NoAssistantTemplate:
    """A tokenizer whose template drops assistant turns and the generation prompt (so no token is ever marked)."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages, **kw):
        kw["add_generation_prompt"] = False
        return self.tok.apply_chat_template([m for m in messages if m["role"] != "assistant"], **kw)


def test_resume_with_different_config_is_refused(tmp_path):
    out = tmp_path / "run"
    run_train(out, "optim.steps=2")
    proc = run_train(out, "optim.steps=3", "resume=true", check=False)
    assert proc.returncode == 2 and "different config" in proc.stderr.strip().splitlines()[-1]


def test_local_rank_argument_is_accepted(tmp_path):
    proc = run_train(tmp_path / "lr", "optim.steps=1", check=False)
    assert proc.returncode == 0
    proc = run_python([*train_cmd(tmp_path / "lr2", "optim.steps=1")[1:], "--local_rank=0"], env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_teacher_feature_cache_is_reused_invalidated_and_faithful(tmp_path):
    cache = tmp_path / "cache"
    opts = ["teacher_cache=true", f"teacher_cache_dir={cache}", "teacher_cache_dtype=float32"]
    first = run_train(tmp_path / "a", *opts)
    assert "writing teacher-feature cache" in first.stderr + first.stdout
    second = run_train(tmp_path / "b", *opts)
    assert "teacher-feature cache hit" in second.stderr + second.stdout
    assert len(os.listdir(cache)) == 1
    run_train(tmp_path / "c", *opts, "model.n=2")  # another layout -> a new entry
    run_train(tmp_path / "d", *opts, "data.max_conversations=30")  # other data -> another entry
    assert len(os.listdir(cache)) == 3
    plain = tmp_path / "plain"
    run_train(plain)
    a, b = weights(tmp_path / "a"), weights(plain)
    for key in a:  # float32 cache: the same function of the same teacher states as the uncached run
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4)


def test_one_teacher_cache_entry_serves_other_layouts_and_methods(tmp_path):
    """An entry written with teacher_cache_layers (the union of n = 2, 3 and EAGLE-3's layers) is reused by runs at
    another n and of another method on the same data, and they train exactly as on an entry of their own."""
    shared, own = tmp_path / "shared", tmp_path / "own"
    opts = ["teacher_cache=true", "teacher_cache_dtype=float32"]
    first = run_train(tmp_path / "a", *opts, f"teacher_cache_dir={shared}", "teacher_cache_layers=[3,5,7]")
    assert "writing teacher-feature cache" in first.stderr + first.stdout
    (entry,) = os.listdir(shared)
    assert json.loads((shared / entry / "meta.json").read_text())["layers"] == [0, 2, 3, 4, 5, 7, 10]
    for name, extra in (("n2", ["model.n=2"]), ("eagle", ["method=eagle3"])):
        reused = run_train(tmp_path / name, *opts, *extra, f"teacher_cache_dir={shared}")
        assert "teacher-feature cache hit" in reused.stderr + reused.stdout
        assert os.listdir(shared) == [entry]
        run_train(tmp_path / f"{name}_own", *opts, *extra, f"teacher_cache_dir={own}")
        a, b = weights(tmp_path / name), weights(tmp_path / f"{name}_own")
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)
    assert len(os.listdir(own)) == 2  # neither of them had a superset entry to share there
    proc = run_train(tmp_path / "bad", *opts, f"teacher_cache_dir={shared}", "teacher_cache_layers=[11]", check=False)
    assert proc.returncode == 2 and "teacher_cache_layers" in proc.stderr.strip().splitlines()[-1]


def test_tokenizing_over_processes_equals_one_process(monkeypatch):
    """Many conversations are rendered by forked workers (a GPU machine's cores): same examples, same order."""
    import spd.train.data as data
    from spd.targets.loading import load_target

    tok = load_target("tiny-llama").tokenizer
    convs = data.load_conversations(DATA, 64)
    convs = convs + [[{"role": "user", "content": "no reply"}]] + convs[:3]   # a conversation with nothing to learn
    serial = data.tokenize_conversations(tok, convs, 256, log=lambda m: None, processes=1)
    monkeypatch.setattr(data, "PARALLEL_FROM", 8)
    forked = data.tokenize_conversations(tok, convs, 256, log=lambda m: None, processes=2)
    assert forked == serial and len(serial) > 40


def test_json_lines_with_unicode_line_separators_inside_strings_load(tmp_path):
    """JSON allows U+2028 / U+0085 unescaped inside a string; a JSONL line holding one is one line, not two."""
    import json

    from spd.train.data import load_conversations

    path = tmp_path / "convs.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"a\u2028b\u0085c {i}"}, {"from": "gpt", "value": "ok"}]}
            for i in range(3)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    convs = load_conversations(str(path), 10)
    assert len(convs) == 3 and convs[0][0]["content"] == "a\u2028b\u0085c 0"


def test_a_run_continues_a_trained_module(tmp_path):
    """init_from=: the module's weights, draft vocabulary and standardisation start the run; steps and tokens count
    on (and a shape the module does not have, or a path that is no module, is refused in one line)."""
    keys = ("model.draft_vocab=64", "model.feature_norm=standard", "eval_decodes=0")
    first = tmp_path / "first"
    run_train(first, "optim.steps=3", *keys)
    before = json.loads((first / "checkpoint" / "config.json").read_text())
    # an lr of ~0 keeps the weights where they started: the continued run's start is the module itself
    still = tmp_path / "still"
    run_train(still, f"init_from={first / 'checkpoint'}", "optim.steps=1", "optim.lr=1e-30", "optim.warmup_steps=0",
              *keys)
    for name, tensor in weights(first).items():
        torch.testing.assert_close(weights(still)[name], tensor, atol=1e-6, rtol=0, msg=name)
    on = tmp_path / "on"
    run_train(on, f"init_from={first / 'checkpoint'}", "optim.steps=2", *keys)
    after = json.loads((on / "checkpoint" / "config.json").read_text())
    assert after["step"] == before["step"] + 2 == 5
    assert after["train_tokens"] > before["train_tokens"] > 0
    assert after["training"]["continued_from"]["step"] == 3
    assert after["training"]["continued_from"]["train_tokens"] == before["train_tokens"]
    assert torch.equal(weights(on)["draft_to_target"], weights(first)["draft_to_target"])
    assert torch.equal(weights(on)["feature_scale"], weights(first)["feature_scale"])
    assert not torch.equal(weights(on)["head.weight"], weights(first)["head.weight"])   # it trained
    for extra, needle in (((f"init_from={first / 'checkpoint'}", "model.n=2"), "n=3"),
                          ((f"init_from={first / 'checkpoint'}", "model.fc_bias=true"), "model.fc_bias=true"),
                          (("init_from=no-such-module",), "neither a checkpoint directory")):
        proc = run_train(tmp_path / "bad", *keys, *extra, check=False)
        assert proc.returncode == 2 and needle in proc.stderr.strip().splitlines()[-1], proc.stderr[-1500:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "bad").exists()
