import json
import os

import torch

from spd.models.checkpoint import load_checkpoint, save_checkpoint
from spd.models.module import SpeculationModule
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


def test_a_float32_module_drafts_for_the_same_target_in_bfloat16_and_float16(tmp_path):
    """A module trained on the float32 target (as the trainer loads it) is accepted by the same source loaded in
    bfloat16 or float16 (GPU runs), and a foreign target is still refused in every dtype."""
    import pytest

    from spd.config import GenerateConfig, load_config
    from spd.errors import UserError
    from spd.session import open_session
    from spd.targets.loading import load_target
    from spd.targets.tiny import save_tiny_target

    own, foreign = tmp_path / "own", tmp_path / "foreign"
    save_tiny_target(str(own), "llama", seed=0)
    save_tiny_target(str(foreign), "llama", seed=1)
    loaded = load_target(str(own), torch.float32, "cpu")
    staged = StagedTarget(loaded.model, 3)
    save_checkpoint(SpeculationModule.from_target(staged, 1, seed=0), loaded, str(tmp_path / "ckpt"))
    for dtype in ("float32", "bfloat16", "float16"):
        keys = [f"checkpoint={tmp_path / 'ckpt'}", f"dtype={dtype}", "method=spd"]
        session = open_session(load_config(GenerateConfig, None, [f"target={own}", *keys]))
        assert session.module is not None and session.staged.n == 3
        assert session.loaded.fingerprint != loaded.fingerprint or dtype == "float32"
        with pytest.raises(UserError, match="was trained for target"):
            open_session(load_config(GenerateConfig, None, [f"target={foreign}", *keys]))
