"""The trained modules inside the package: which one a run gets, and that each loads on the default target
and decodes losslessly."""

import pytest
import torch

from spd.runtime.ar import ARDecoder
from spd.models.checkpoint import load_checkpoint, read_checkpoint_config
from spd.decoding import Request
from spd.decoding import eos_ids_of
from spd.drafters.spd_module import ModuleDrafter
from spd.corpora.prompts import chat_prompt_ids
from spd.runtime.pipeline import PipelineDecoder
from spd.verify.sampling import SamplingParams
from spd.models.shipped import RANDOM, checkpoint_for, shipped_modules
from spd.targets.stages import StagedTarget

SHIPPED = shipped_modules()


def test_a_module_ships_for_the_default_target_at_n5():
    assert any(m["n"] == 5 and m["target"]["name"] == "SmolLM2-135M-Instruct" for m in SHIPPED), SHIPPED
    for m in SHIPPED:  # each records how it was made and what it measured
        assert {"command", "data_sha256", "train_tokens", "measured"} <= set(m["provenance"]), m["path"]


def test_which_module_a_run_gets():
    n5 = next(m for m in SHIPPED if m["n"] == 5)
    inner = n5["stage_bounds"][1:-1]
    assert checkpoint_for(None, "smollm2", None, None) == n5["path"]        # no n: the default pipeline's
    for m in SHIPPED:                                       # the run's method, n and bounds pick it
        method = m.get("method", "spd")
        assert checkpoint_for(None, "smollm2", m["n"], m["stage_bounds"][1:-1], method) == m["path"]
        assert checkpoint_for(None, "smollm2", m["n"], None, method) == m["path"]
        if method != "spd":                                 # never another method's module
            assert checkpoint_for(None, "smollm2", m["n"], None) != m["path"]
    assert checkpoint_for(None, "smollm2", 5, None) == n5["path"]
    assert checkpoint_for(None, "smollm2", 5, inner) == n5["path"]
    assert checkpoint_for(RANDOM, "smollm2", 5, None) is None              # untrained on request
    assert checkpoint_for("some/dir", "smollm2", 5, None) == "some/dir"    # an explicit one always wins
    assert checkpoint_for(None, "tiny-llama", 5, None) is None             # only for the target it was trained on
    assert checkpoint_for(None, "smollm2", 29, None) is None               # no module for that n
    assert checkpoint_for(None, "smollm2", 5, "balanced") is None          # bounds measured here: no default


@pytest.mark.slow
@pytest.mark.parametrize("module", SHIPPED, ids=lambda m: m["path"].rsplit("/", 1)[-1])
def test_shipped_module_loads_on_the_default_target_and_is_lossless(module):
    from spd.targets.loaded import reduced_fingerprints
    from spd.targets.loading import load_target

    loaded = load_target("smollm2")
    cfg = read_checkpoint_config(module["path"])
    assert cfg["target"]["fingerprint"] == loaded.fingerprint
    # the same weights as a bfloat16 / float16 load gives them: the module drafts for GPU runs in those dtypes
    assert cfg["target"]["fingerprints"] == reduced_fingerprints(loaded.model)
    staged = StagedTarget(loaded.model, cfg["n"], cfg["stage_bounds"])
    drafter_module = load_checkpoint(module["path"], staged, loaded).eval()
    assert drafter_module.head.weight.dtype == torch.float32     # stored in float16, widened on load
    ids = chat_prompt_ids(loaded.tokenizer, "Tom has 3 boxes of 12 pencils and gives away 7. How many are left?")
    eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
    reference = ARDecoder(StagedTarget(loaded.model, 1), eos).generate(ids, Request(48, SamplingParams()))
    if cfg.get("method") == "eagle3":                 # a chain's drafter: m = 5 drafts, one target forward
        from spd.drafters.eagle3 import Eagle3Drafter
        from spd.runtime.chain import ChainDecoder

        decoder = ChainDecoder(staged, Eagle3Drafter(drafter_module, staged.embed), eos, 5)
        out = decoder.generate(ids, Request(48, SamplingParams()))
        accepted = out.stats.tau
    else:
        out = PipelineDecoder(staged, ModuleDrafter(drafter_module), eos).generate(ids, Request(48, SamplingParams()))
        accepted = out.stats.eal
    assert out.token_ids == reference.token_ids
    assert accepted > 1.1, out.stats    # a trained module: drafts get accepted


def test_ship_script_halves_the_weights_and_records_provenance(tmp_path, monkeypatch):
    import importlib.util
    import json
    import os

    from safetensors.torch import load_file

    import spd.models.shipped
    from spd.models.checkpoint import save_checkpoint
    from spd.models.module import SpeculationModule
    from spd.targets.loading import load_target

    loaded = load_target("tiny-llama")
    staged = StagedTarget(loaded.model, 3)
    module = SpeculationModule.from_target(staged, 1, draft_to_target=torch.arange(0, 128, 2),
                                           feature_norm="standard").eval()
    module.feature_shift.normal_()
    save_checkpoint(module, loaded, str(tmp_path / "ckpt"),
                    {"step": 7, "train_tokens": 1234, "training": {"command": "python train/run.py x=1",
                                                                  "data_sha256": "ab" * 32}})
    (tmp_path / "acc.json").write_text(json.dumps({"eal_pooled": 1.5, "eal_per_dataset": {"gsm8k": 1.5},
                                                   "limit": 20, "max_new_tokens": 128}))
    monkeypatch.setattr(spd.models.shipped, "SHIPPED_DIR", str(tmp_path / "modules"))
    spec = importlib.util.spec_from_file_location("ship", os.path.join(os.path.dirname(__file__), "..", "train",
                                                                       "ship.py"))
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    assert ship.main([str(tmp_path / "ckpt"), "tiny-n3", "--measured", str(tmp_path / "acc.json"),
                      "--measured-command", "python -m bench.acceptance ..."]) == 0
    dest = tmp_path / "modules" / "tiny-n3"
    state = load_file(str(dest / "model.safetensors"))
    assert state["head.weight"].dtype == torch.float16 and state["draft_to_target"].dtype == torch.int64
    assert state["feature_shift"].dtype == torch.float32
    (shipped,) = spd.models.shipped.shipped_modules()
    assert shipped["provenance"]["train_tokens"] == 1234 and shipped["provenance"]["measured"]["eal_pooled"] == 1.5
    assert shipped["provenance"]["command"] == "python train/run.py x=1"
    again = load_checkpoint(str(dest), staged, loaded)
    hidden = {l: torch.randn(1, 6, loaded.model.config.hidden_size) for l in range(loaded.model.config.num_hidden_layers + 1)}
    with torch.no_grad():
        torch.testing.assert_close(again(hidden, torch.tensor([2])), module(hidden, torch.tensor([2])),
                                   atol=2e-2, rtol=2e-2)
    # --if-better: a module re-ships only on a higher L'acc measured the same way
    for value, shipped_after in ((1.4, 1.5), (1.6, 1.6)):
        (tmp_path / "acc2.json").write_text(json.dumps({"eal_pooled": value, "eal_per_dataset": {"gsm8k": value},
                                                        "limit": 20, "max_new_tokens": 128}))
        assert ship.main([str(tmp_path / "ckpt"), "tiny-n3", "--measured", str(tmp_path / "acc2.json"),
                          "--measured-command", "python -m bench.acceptance ...", "--if-better"]) == 0
        (shipped,) = spd.models.shipped.shipped_modules()
        assert shipped["provenance"]["measured"]["eal_pooled"] == shipped_after
    (tmp_path / "acc3.json").write_text(json.dumps({"eal_pooled": 9.0, "eal_per_dataset": {}, "limit": 5,
                                                    "max_new_tokens": 128}))
    with pytest.raises(SystemExit, match="not comparable"):
        ship.main([str(tmp_path / "ckpt"), "tiny-n3", "--measured", str(tmp_path / "acc3.json"),
                   "--measured-command", "x", "--if-better"])


def test_ship_records_eagle3s_tau_from_an_eval_summary(tmp_path):
    import importlib.util
    import json
    import os

    spec = importlib.util.spec_from_file_location("ship", os.path.join(os.path.dirname(__file__), "..", "train",
                                                                       "ship.py"))
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    summary = {"run": {"max_new_tokens": 256, "temperature": 0.0}, "overall": {"tau_pooled": 1.4, "samples": 6},
               "datasets": {"gsm8k": {"tau_pooled": 1.3}, "humaneval": {"tau_pooled": 1.5}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    got = ship.measured_of(str(tmp_path / "summary.json"), "spd-infer eval method=eagle3 ...")
    assert got["tau_pooled"] == 1.4 and got["tau_per_dataset"] == {"gsm8k": 1.3, "humaneval": 1.5}
    assert "eal_pooled" not in got and got["samples"] == 6
