"""data.regenerate: the target's own replies, written once, reused, and resumed exactly after an interruption."""

import json
import os

from spd.targets.loading import load_target
from spd.train.data import load_conversations
from spd.train.regenerate import first_prompt, regenerate, regenerated_path

from test_train import DATA, run_train


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_regenerate_writes_reuses_and_resumes(tmp_path):
    loaded = load_target("tiny-llama")
    convs = load_conversations(DATA, 6)
    settings = {"temperature": 1.0}
    path = regenerated_path(str(tmp_path), loaded.fingerprint, DATA, convs, settings)
    kwargs = dict(temperature=1.0, max_new_tokens=6, max_prompt_tokens=200, batch_size=2, seed=3, log=lambda m: None)
    regenerate(loaded.model, loaded.tokenizer, convs, path, **kwargs)
    full = _lines(path)
    assert len(full) == 6 and not os.path.exists(path + ".partial")
    for row in full:  # first user turn kept verbatim, reply replaced by the target's
        assert row["messages"][:-1] == first_prompt(convs[row["index"]])
        assert row["messages"][-1]["role"] == "assistant"
    assert any(row["messages"][-1]["content"] for row in full)
    # reuse: an existing file is returned untouched
    mtime = os.path.getmtime(path)
    regenerate(loaded.model, loaded.tokenizer, convs, path, **kwargs)
    assert os.path.getmtime(path) == mtime
    # interrupted mid-batch with a torn last line: resuming gives the same file as the uninterrupted run
    os.remove(path)
    with open(path + ".partial", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in full[:3])
        f.write('{"index": 9, "mess')
    regenerate(loaded.model, loaded.tokenizer, convs, path, **kwargs)
    assert _lines(path) == full
    # the key changes with the settings and with the prompts
    assert regenerated_path(str(tmp_path), loaded.fingerprint, DATA, convs, {"temperature": 0.0}) != path
    assert regenerated_path(str(tmp_path), loaded.fingerprint, DATA, convs[:5], settings) != path


def test_trainer_regenerates_then_trains(tmp_path):
    cache = tmp_path / "regen"
    run_train(tmp_path / "run", "data.regenerate=true", "data.regenerate_new_tokens=8",
              f"data.regenerated_dir={cache}", "optim.steps=2", "save_every=0")
    files = os.listdir(cache)
    assert len(files) == 1 and files[0].endswith(".jsonl")
    ckpt = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())
    assert ckpt["training"]["regenerated"] is True
