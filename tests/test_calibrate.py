import math

import pytest

from spd.eval.calibrate import (
    ar_token_time,
    calibrate,
    calibrate_chain,
    chain_measured_cost_speedup,
    formula_speedup,
    measured_cost_speedup,
    step_time,
)
from spd.drafters.eagle3 import Eagle3Drafter
from spd.models.eagle3 import Eagle3Module
from spd.models.module import SpeculationModule
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget


@pytest.fixture(scope="module")
def staged_and_module():
    staged = StagedTarget(load_target("tiny-llama").model, 3)
    return staged, SpeculationModule.from_target(staged, 1).eval()


def hand_calibration(stages, head, verify, module):
    step, bottleneck = step_time(stages, head, verify, module)
    return {"stage_s": stages, "head_s": head, "verify_s": verify, "module_s": module,
            "ar_token_s": ar_token_time(stages, head), "step_s": step, "bottleneck": bottleneck}


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, top_p=0.9)])
def test_calibrate_is_consistent_with_its_model(staged_and_module, params):
    staged, module = staged_and_module
    cal = calibrate(staged, module, params, context=16, repeats=3)
    assert len(cal["stage_s"]) == staged.n and all(t > 0 for t in cal["stage_s"])
    assert cal["head_s"] > 0 and cal["module_s"] > 0 and cal["verify_s"] > 0
    assert math.isclose(cal["ar_token_s"], sum(cal["stage_s"]) + cal["head_s"])
    terms = {"stage 1": cal["stage_s"][0], "stage 2": cal["stage_s"][1],
             "last stage + head + verify": cal["stage_s"][2] + cal["head_s"] + cal["verify_s"],
             "module": cal["module_s"]}
    assert math.isclose(cal["step_s"], max(terms.values()))
    assert terms[cal["bottleneck"]] == cal["step_s"]
    assert (cal["context"], cal["repeats"], cal["device"], cal["dtype"]) == (16, 3, "cpu", "torch.float32")


def test_calibrate_needs_a_full_pipeline(staged_and_module):
    staged, module = staged_and_module
    with pytest.raises(ValueError, match="context"):
        calibrate(staged, module, SamplingParams(), context=2, repeats=1)


def test_hand_computed_speedup():
    cal = hand_calibration([1.0, 1.0, 1.0], head=1.0, verify=0.0, module=0.5)
    assert cal["ar_token_s"] == 4.0 and cal["step_s"] == 2.0
    assert cal["bottleneck"] == "last stage + head + verify"
    assert measured_cost_speedup(0.5, cal) == pytest.approx(1.0)
    assert formula_speedup(0.5, 3) == pytest.approx(1.5)


def test_bottleneck_names_the_slowest_term():
    assert step_time([1.0, 3.0, 1.0], 0.5, 0.1, 0.2) == (3.0, "stage 2")
    assert step_time([1.0, 1.0, 1.0], 0.5, 0.1, 2.5) == (2.5, "module")
    assert step_time([2.0], 0.5, 0.0, 1.0) == (2.5, "last stage + head + verify")  # n = 1: no other stage
    # the controller in stage 1's process: stage 1, the module and the verification take turns there
    assert step_time([2.0, 2.0], 0.5, 0.25, 1.0, hosted=True) == (3.25, "stage 1 + module")
    assert step_time([1.0, 2.0], 0.5, 0.25, 1.0, hosted=True) == (2.5, "last stage + head")


@pytest.mark.parametrize("n,alpha", [(1, 1.0), (3, 0.4), (5, 0.73)])
def test_free_extras_and_equal_stages_give_the_formula(n, alpha):
    cal = hand_calibration([0.01] * n, head=0.0, verify=0.0, module=0.0)
    assert measured_cost_speedup(alpha, cal) == pytest.approx(formula_speedup(alpha, n))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, top_p=0.9)])
def test_calibrate_chain_is_consistent_with_its_model(params):
    staged = StagedTarget(load_target("tiny-llama").model, 1)
    drafter = Eagle3Drafter(Eagle3Module.from_target(staged).eval(), staged.embed)
    cal = calibrate_chain(staged, drafter, params, m=3, context=16, repeats=3)
    parts = [cal["drafts_s"], cal["verify_s"], cal["update_s"]]
    assert cal["ar_token_s"] > 0 and all(t > 0 for t in parts)
    assert math.isclose(cal["cycle_s"], sum(parts))
    assert (cal["m"], cal["context"], cal["repeats"]) == (3, 16, 3)
    # the drafter is left where calibration put it: every context position has its row, nothing of the timed drafts
    assert drafter.rows == 16 and drafter.kv.get_seq_length(0) == 16
    assert (cal["W"], cal["rows"]) == (1, 4)


def test_calibrate_chain_prices_the_tree_it_drafts():
    staged = StagedTarget(load_target("tiny-llama").model, 1)
    drafter = Eagle3Drafter(Eagle3Module.from_target(staged).eval(), staged.embed)
    cal = calibrate_chain(staged, drafter, SamplingParams(temperature=1.0), m=3, context=16, repeats=3, width=4,
                          budget=10)
    assert (cal["W"], cal["rows"]) == (4, 11) and cal["verify_s"] > 0 and cal["drafts_s"] > 0
    assert drafter.rows == 16 and drafter.kv.get_seq_length(0) == 16     # no tree row left in the draft cache


def test_chain_measured_cost_speedup_by_hand():
    # τ = 1.5 tokens per cycle of 3 drafts at 0.1 s, a 0.5 s verify and a 0.1 s update, against 0.6 s per AR token
    cal = {"ar_token_s": 0.6, "cycle_s": 3 * 0.1 + 0.5 + 0.1}
    assert math.isclose(chain_measured_cost_speedup(1.5, cal), 1.5 * 0.6 / 0.9)


@pytest.mark.parametrize("method", ["spd", "ppsd"])
def test_calibrate_prices_a_pipeline_tree(method):
    """W = 4: every stage but the last two runs a level of 4 rows, the module drafts for 4 tips, and plain AR is
    still priced on one row per stage; the cache keeps its context length."""
    staged = StagedTarget(load_target("tiny-llama").model, 4)
    module = SpeculationModule.from_target(staged, 1, method=method).eval()
    cal = calibrate(staged, module, SamplingParams(temperature=1.0), context=16, repeats=3, width=4)
    assert (cal["W"], cal["rows"]) == (4, [4, 4, 1, 1])
    assert math.isclose(cal["ar_token_s"], sum(cal["ar_stage_s"]) + cal["head_s"])
    step, bottleneck = step_time(cal["stage_s"], cal["head_s"], cal["verify_s"], cal["module_s"],
                                 module.plan.after_step)
    assert (cal["step_s"], cal["bottleneck"]) == (step, bottleneck)


def test_rows_priced_step_by_hand():
    """FlowSpec's / PipeDec's steps: the slowest of the stages at their rows (idle ones free), the last also running
    the head and settling its exiting rows, and the draft side beside them."""
    from spd.eval.calibrate import priced_step, rows_measured_cost_speedup

    costs = {"stage_s": {"1": [1.0, 2.0, 3.0], "2": [1.5, 2.5, 3.5]}, "head_s": {"1": 0.5, "2": 0.8},
             "verify_s": 0.1, "draft_s": 0.2, "ar_token_s": 7.0}
    assert priced_step((2, 1, 0), costs) == 2.0                   # stage 2 sets it; stage 3 idles
    assert priced_step((1, 2, 2), costs) == pytest.approx(3.5 + 0.8 + 2 * 0.1)
    assert priced_step((0, 0, 0), costs) == 0.2                   # nothing in flight: only the draft side
    pipedec = {**costs, "draft_s": {"1": 0.3, "2": 5.0}}          # a draft model over the tips that entered
    assert priced_step((2, 1, 1), pipedec) == 5.0 and priced_step((0, 1, 1), pipedec) == pytest.approx(3.6)
    speedup = rows_measured_cost_speedup(0.5, {"2,1,0": 1, "1,2,2": 3}, costs)
    assert speedup == pytest.approx(0.5 * 7.0 / ((2.0 + 3 * 4.5) / 4))


def test_calibrate_rows_times_every_row_count_it_prices():
    """Each stage is timed at each row count it ran (and one row, AR's price), the head at each count that exited,
    the draft model at each count of tips; AR per token = Σ one-row stages + head."""
    from spd.drafters.draft_model import DraftLM
    from spd.eval.calibrate import calibrate_rows, priced_step

    staged = StagedTarget(load_target("tiny-llama").model, 3)
    step_rows = {"2,1,0": 3, "4,2,1": 1, "0,3,2": 2}
    cal = calibrate_rows(staged, SamplingParams(), step_rows, draft_model=DraftLM(staged, 1), children=2,
                         context=16, repeats=2)
    timed = {r: [t is not None for t in ts] for r, ts in cal["stage_s"].items()}
    assert timed == {"1": [True, True, True], "2": [True, True, True], "3": [False, True, False],
                     "4": [True, False, False]}
    assert sorted(cal["head_s"]) == ["1", "2"] and sorted(cal["draft_s"]) == ["1", "2", "4"]
    assert math.isclose(cal["ar_token_s"], sum(cal["stage_s"]["1"]) + cal["head_s"]["1"])
    assert all(priced_step(tuple(map(int, key.split(","))), cal) > 0 for key in step_rows)
    grown = []
    flowspec = calibrate_rows(staged, SamplingParams(), {"1,1,1": 1}, grow=lambda: grown.append(1), context=16,
                              repeats=2)
    assert grown and flowspec["draft_s"] > 0 and flowspec["rows_priced"]
