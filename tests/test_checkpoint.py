import json
import os

import torch

from spd.checkpoint import load_checkpoint, save_checkpoint
from spd.module import SpeculationModule
from spd.targets.loading import LoadedTarget, weights_fingerprint
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model


def test_roundtrip_is_exact_and_atomic(tmp_path):
    model = tiny_model("qwen3")
    loaded = LoadedTarget(model, None, "tiny-qwen3", weights_fingerprint(model))
    staged = StagedTarget(model, 5)
    draft = torch.tensor([5, 9, 2, 40, 7])
    module = SpeculationModule.from_target(staged, 2, draft_to_target=draft, seed=4)
    path = tmp_path / "ckpt"
    save_checkpoint(module, loaded, str(path))
    save_checkpoint(module, loaded, str(path))  # overwriting an existing checkpoint is atomic too
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directories left behind
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["n"] == 5 and cfg["stage_bounds"] == staged.bounds and cfg["module_layers"] == 2
    assert cfg["target"]["fingerprint"] == loaded.fingerprint and cfg["draft_vocab_size"] == 5
    assert cfg["feature_layers"][1] == [0, 1, 2]
    again = load_checkpoint(str(path), staged, loaded)
    for (k, a), (_, b) in zip(module.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert torch.equal(again.draft_to_target, draft)


def test_fingerprint_tracks_weights():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert weights_fingerprint(a) == weights_fingerprint(tiny_model("llama", seed=0))
    assert weights_fingerprint(a) != weights_fingerprint(b)
