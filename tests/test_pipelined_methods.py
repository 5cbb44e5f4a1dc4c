"""PPSD and SPD's output-state ablation (paper Table 2) run in the same decoding loop as SPD, from the same module
class, with their own feature plan: which depth each row reads and that they draft after the step."""

import pytest
import torch

from helpers import GREEDY, ar_run, prompt, spd_run
from spd.decoding import Request
from spd.drafters.spd_module import ModuleDrafter
from spd.eval.calibrate import formula_speedup, step_time
from spd.eval.fast import record_greedy_trace
from spd.eval.fast_trace import fast_greedy_stats
from spd.layout import PLANS, depth, plan_for
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineDecoder
from spd.targets.stages import StagedTarget

AFTER = ["ppsd", "spd_output_state"]


def test_output_state_reads_every_in_flight_token_one_stage_deeper():
    plan = plan_for("spd_output_state")
    # n = 4, full pipeline (a = 4), step for t = 10: tokens 10, 9, 8 in flight after the step at depths 1, 2, 3;
    # 7 has just left the last stage (depth 4 = n), older ones are memory
    assert [plan.depth(10, i, 4, 4) for i in (10, 9, 8, 7, 6, 0)] == [1, 2, 3, 4, 4, 4]
    # warm-up (a = 2): 10 and 9 in flight at depths 1 and 2, everything older has left
    assert [plan.depth(10, i, 2, 4) for i in (10, 9, 8)] == [1, 2, 4]
    assert plan.depths(4) == [1, 2, 3, 4] and plan.query_depth() == 1 and plan.memory_depth(4) == 4
    assert plan.lag_depths(4) == {1: 2, 2: 3}   # lag 3 reads depth 4, the memory depth
    assert [plan.depth(10, i, 3, 4) for i in (10, 9, 8)] == [depth(10, i, 3, 4) + 1 for i in (10, 9, 8)]


def test_ppsd_reads_the_stage_one_output_of_every_position():
    plan = plan_for("ppsd")
    bounds = [0, 6, 12, 18, 24, 30]
    assert plan.feature_layers(bounds) == {1: (6,)} and plan.needed_layers(bounds) == [6]
    assert {plan.depth(10, i, a, 5) for i in range(11) for a in range(1, 6)} == {1}
    assert plan.lag_depths(5) == {} and plan.after_step
    with pytest.raises(ValueError):
        plan.depth(3, 4, 1, 5)


@pytest.mark.parametrize("method", list(PLANS))
@pytest.mark.parametrize("n", [1, 3, 5])
def test_depth_grid_is_the_plans_rule(method, n):
    plan = plan_for(method)
    occupancy = torch.arange(1, n + 1).repeat(2)
    grid = plan.depth_grid(9, occupancy, n)
    for b, a in enumerate(occupancy.tolist()):
        for t in range(9):
            for i in range(9):
                assert grid[b, t, i] == (plan.depth(t, i, a, n) if i <= t else -1)


@pytest.mark.parametrize("method", AFTER)
@pytest.mark.parametrize("n", [2, 5])
def test_greedy_equals_ar(family_model, method, n):
    family, model = family_model
    for seed in range(2):
        p = prompt(seed + 40)
        ar = ar_run(model, p, 40)
        out, _, module = spd_run(model, n, p, 40, seed=seed, method=method)
        assert module.plan.method == method
        assert out.token_ids == ar.token_ids, (family, method, n, seed)
        assert out.stats.rollbacks > 0


@pytest.mark.parametrize("method", AFTER)
def test_fast_evaluator_matches_runtime(family_model, method):
    _, model = family_model
    staged = StagedTarget(model, 3)
    accepted = 0
    for seed in range(3):
        p = prompt(seed + 60)
        module = SpeculationModule.from_target(staged, 1, seed=seed, method=method)
        module.init_selectors()
        module.init_layers_from([staged.layers[staged.attention_near(-1)]])   # some acceptance, so accepted runs are compared too
        module.eval()
        trace = record_greedy_trace(staged, p, 40, frozenset())
        fast = fast_greedy_stats(module, trace)
        slow = PipelineDecoder(staged, ModuleDrafter(module), frozenset()).generate(p, Request(40, GREEDY))
        assert slow.token_ids == trace.tokens
        assert (fast["stats"].N, fast["stats"].K, fast["stats"].rollbacks, fast["stats"].accepted_runs) == \
            (slow.stats.N, slow.stats.K, slow.stats.rollbacks, slow.stats.accepted_runs)
        accepted += slow.stats.N - 1 - slow.stats.rollbacks
    assert accepted > 0


def test_after_step_cost_adds_the_module_to_every_step():
    assert step_time([1.0, 3.0, 1.0], 0.5, 0.1, 0.2, after_step=True) == (3.2, "stage 2, then the module")
    assert step_time([1.0, 1.0, 1.0], 0.5, 0.1, 2.5, after_step=True)[0] == pytest.approx(4.1)
    # S = L'acc * L / (L_s * n + L): PPSD at n = 5 with L = 30, L_s = 1 and alpha 0.4 -> 2.0 * 30 / 35
    assert formula_speedup(0.4, 5, True, 30, 1) == pytest.approx(2.0 * 30 / 35)
    assert formula_speedup(0.4, 5) == pytest.approx(2.0)
