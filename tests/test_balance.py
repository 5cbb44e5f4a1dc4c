"""Cost-balanced stage boundaries: the dynamic programme is exact (checked against brute force), the head's cost
moves layers off the last stage, and a module trained for other bounds is refused with the bounds it needs."""

import itertools
import json
import subprocess
import sys

import pytest

from spd.runtime.balance import balanced_bounds, profile_costs, stage_costs
from spd.target.loading import load_target
from spd.target.stages import StagedTarget


def brute_force(costs, n):
    layers = len(costs["layer_s"])
    best = None
    for inner in itertools.combinations(range(1, layers), n - 1):
        bounds = [0, *inner, layers]
        slowest = max(stage_costs(bounds, costs))
        if best is None or slowest < best[0] - 1e-12:
            best = (slowest, bounds)
    return best[0]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_balanced_bounds_minimise_the_slowest_stage(seed, n):
    import random

    rng = random.Random(seed)
    costs = {"layer_s": [rng.uniform(0.5, 2.0) for _ in range(9)], "head_s": rng.uniform(0, 6)}
    bounds = balanced_bounds(costs, n)
    assert bounds[0] == 0 and bounds[-1] == 9 and len(bounds) == n + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert max(stage_costs(bounds, costs)) == pytest.approx(brute_force(costs, n))


def test_an_expensive_head_shortens_the_last_stage():
    costs = {"layer_s": [1.0] * 30, "head_s": 8.0}  # SmolLM2 on a CPU core: the head ~ 8 decoder layers
    assert balanced_bounds(costs, 2) == [0, 19, 30]
    assert balanced_bounds({"layer_s": [1.0] * 30, "head_s": 0.0}, 2) == [0, 15, 30]


def test_profile_times_every_layer_and_the_head():
    staged = StagedTarget(load_target("tiny-llama").model, 1)
    costs = profile_costs(staged, context=16, repeats=3)
    assert len(costs["layer_s"]) == staged.num_layers and all(t > 0 for t in costs["layer_s"])
    assert costs["head_s"] > 0 and costs["embed_s"] > 0


def test_balanced_run_reports_its_bounds_and_refuses_a_module_for_other_bounds(tmp_path):
    from spd.checkpoint import save_checkpoint
    from spd.module import SpeculationModule

    args = ["target=tiny-llama", "prompt=What is 12*7?", "max_new_tokens=8", "json=true", "n=2",
            "stage_bounds=balanced", "runtime=distributed", "threads_per_stage=1"]
    out = subprocess.run([sys.executable, "-m", "spd.cli", "generate", *args], capture_output=True, text=True,
                         timeout=240)
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
    refused = subprocess.run([sys.executable, "-m", "spd.cli", "generate", *args, f"checkpoint={tmp_path / 'ckpt'}"],
                             capture_output=True, text=True, timeout=240)
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("spd-infer: error:") and f"stage_bounds={other}" in line
    assert f"model.stage_bounds={balance['stage_bounds'][1:-1]}" in line
