"""Cost-balanced stage boundaries: the dynamic programme is exact (checked against brute force), the head's cost
moves layers off the last stage, a controller running stage 1 moves layers off the first, where the controller
runs follows the cores and torchrun's world, and a module trained for other bounds is refused with the bounds it
needs."""

import itertools
import json

import pytest

from spd.errors import UserError
from spd.runtime.balance import balanced_bounds, controller_costs, profile_costs, stage_costs
from spd.runtime.stages import hosts_first_stage, threads_for
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from launch import run_python


def brute_force(costs, n, first_extra_s=0.0):
    layers = len(costs["layer_s"])
    best = None
    for inner in itertools.combinations(range(1, layers), n - 1):
        bounds = [0, *inner, layers]
        slowest = max(stage_costs(bounds, costs, first_extra_s))
        if best is None or slowest < best[0] - 1e-12:
            best = (slowest, bounds)
    return best[0]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_balanced_bounds_minimise_the_slowest_stage(seed, n):
    import random

    rng = random.Random(seed)
    costs = {"layer_s": [rng.uniform(0.5, 2.0) for _ in range(9)], "head_s": rng.uniform(0, 6)}
    for extra in (0.0, rng.uniform(0, 4)):
        bounds = balanced_bounds(costs, n, extra)
        assert bounds[0] == 0 and bounds[-1] == 9 and len(bounds) == n + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:]))
        assert max(stage_costs(bounds, costs, extra)) == pytest.approx(brute_force(costs, n, extra))


def test_an_expensive_head_shortens_the_last_stage():
    costs = {"layer_s": [1.0] * 30, "head_s": 8.0}  # SmolLM2 on a CPU core: the head ~ 8 decoder layers
    assert balanced_bounds(costs, 2) == [0, 19, 30]
    assert balanced_bounds({"layer_s": [1.0] * 30, "head_s": 0.0}, 2) == [0, 15, 30]


def test_a_controller_in_stage_1_shortens_the_first_stage():
    costs = {"layer_s": [1.0] * 30, "head_s": 8.0, "embed_s": 0.0}
    drafter = controller_costs(costs, module_layers=1, draft_vocab=16384, vocab=49152)   # 1 layer + 1/3 of the head
    assert drafter == pytest.approx(1.0 + 8.0 / 3)
    assert balanced_bounds(costs, 2, drafter) == [0, 17, 30]
    assert controller_costs(costs, 1, None, 49152) == 0.0   # no module: the embedding alone


def test_the_controller_runs_stage_1_where_cores_are_short(monkeypatch):
    import spd.runtime.stages as stages

    monkeypatch.setattr(stages, "cores", lambda: 2)
    assert hosts_first_stage("auto", 2, "cpu") and hosts_first_stage("auto", 5, "cpu")
    assert not hosts_first_stage("auto", 1, "cpu") and not hosts_first_stage("auto", 2, "cuda")
    assert threads_for(2, None, hosted=True) == 1 and threads_for(1, None) == 1
    monkeypatch.setattr(stages, "cores", lambda: 16)
    assert not hosts_first_stage("auto", 5, "cpu") and threads_for(5, None) == 2 and threads_for(5, None, True) == 3
    assert hosts_first_stage("first_stage", 2, "cpu") and not hosts_first_stage("own_process", 2, "cpu")
    # under torchrun the world decides: n processes -> the controller runs stage 1, n + 1 -> its own process
    assert hosts_first_stage("auto", 3, "cpu", world=3) and not hosts_first_stage("auto", 3, "cpu", world=4)
    for controller, world in (("auto", 5), ("first_stage", 4), ("own_process", 3)):
        with pytest.raises(UserError, match="torchrun started"):
            hosts_first_stage(controller, 3, "cpu", world=world)
    with pytest.raises(UserError, match="n >= 2"):
        hosts_first_stage("first_stage", 1, "cpu")


def test_profile_times_every_layer_and_the_head():
    staged = StagedTarget(load_target("tiny-llama").model, 1)
    costs = profile_costs(staged, context=16, repeats=3)
    assert len(costs["layer_s"]) == staged.num_layers and all(t > 0 for t in costs["layer_s"])
    assert costs["head_s"] > 0 and costs["embed_s"] > 0


def test_balanced_run_reports_its_bounds_and_refuses_a_module_for_other_bounds(tmp_path):
    from spd.models.checkpoint import save_checkpoint
    from spd.models.module import SpeculationModule

    args = ["target=tiny-llama", "prompt=What is 12*7?", "max_new_tokens=8", "json=true", "n=2",
            "stage_bounds=balanced", "runtime=distributed", "threads_per_stage=1"]
    out = run_python(["-m", "spd.cli", "generate", *args], timeout=240)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    balance = result["balance"]
    assert result["stage_bounds"] == balance["stage_bounds"]
    assert balance["predicted_step_s"] == max(balance["stage_s"]) > 0
    assert "stage_bounds=balanced -> " in out.stderr
    loaded = load_target("tiny-llama")
    other = [0, 1, 10] if balance["stage_bounds"] != [0, 1, 10] else [0, 2, 10]
    module = SpeculationModule.from_target(StagedTarget(loaded.model, 2, other), 1)
    save_checkpoint(module, loaded, str(tmp_path / "ckpt"))
    refused = run_python(["-m", "spd.cli", "generate", *args, f"checkpoint={tmp_path / 'ckpt'}"], timeout=240)
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("spd-infer: error:") and f"stage_bounds={other}" in line
    assert f"model.stage_bounds={balance['stage_bounds'][1:-1]}" in line
