"""The fast greedy evaluator reproduces the step-by-step runtime's N, K and rollbacks exactly."""

import pytest

from helpers import GREEDY, prompt
from spd.decoding import Request
from spd.drafters.spd_module import ModuleDrafter
from spd.eval.fast import record_greedy_trace
from spd.eval.fast_trace import fast_greedy_stats
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineDecoder
from spd.targets.stages import StagedTarget


def trained_like(staged, seed):
    """A module with real acceptance: selector FCs and the target's last layers copied in."""
    module = SpeculationModule.from_target(staged, 1, seed=seed)
    module.init_selectors()
    module.init_layers_from([staged.layers[staged.attention_near(-1)]])
    return module.eval()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_fast_evaluator_matches_runtime(family_model, n):
    _, model = family_model
    staged = StagedTarget(model, n)
    accepted = 0
    for seed in range(3):
        p = prompt(seed + 20)
        for module in (SpeculationModule.from_target(staged, 1, seed=seed).eval(), trained_like(staged, seed)):
            trace = record_greedy_trace(staged, p, 40, frozenset())
            fast = fast_greedy_stats(module, trace)
            slow = PipelineDecoder(staged, ModuleDrafter(module), frozenset()).generate(p, Request(40, GREEDY))
            assert slow.token_ids == trace.tokens
            assert (fast["stats"].N, fast["stats"].K, fast["stats"].rollbacks) == \
                (slow.stats.N, slow.stats.K, slow.stats.rollbacks)
            assert fast["stats"].accepted_runs == slow.stats.accepted_runs
            accepted += slow.stats.N - 1 - slow.stats.rollbacks
    assert accepted > 0  # the comparison covered accepted drafts, not only rollbacks
