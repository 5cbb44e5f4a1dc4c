"""Metric arithmetic with drafters whose acceptance is known exactly."""

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.reference import ReferenceDrafter
from spd.metrics import DecodeStats, pooled_eal
from spd.runtime.pipeline import PipelineDecoder
from spd.targets.stages import StagedTarget


def run_reference(model, n, wrong, max_new):
    p = prompt(11)
    reference = p + ar_run(model, p, max_new + n + 2).token_ids
    staged = StagedTarget(model, n)
    drafter = ReferenceDrafter(reference, model.config.vocab_size, wrong=wrong)
    out = PipelineDecoder(staged, drafter, frozenset()).generate(p, Request(max_new, GREEDY))
    assert out.token_ids == reference[len(p): len(p) + max_new]
    return out.stats


@pytest.mark.parametrize("n", [1, 2, 3, 5, 10])
def test_oracle_drafter_steps(family_model, n):
    _, model = family_model
    for max_new in (1, 2, 7, 40):
        stats = run_reference(model, n, wrong=False, max_new=max_new)
        assert stats.N == max_new
        assert stats.K == (0 if max_new == 1 else max_new + n - 2)
        assert stats.rollbacks == 0
    long = run_reference(model, n, wrong=False, max_new=400)
    assert long.eal == pytest.approx(n * 400 / (400 + n - 2))
    assert long.eal > 0.97 * n  # L'acc -> n as N grows
    assert long.accepted_runs == [399]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_always_wrong_drafter(family_model, n):
    _, model = family_model
    N = 60
    stats = run_reference(model, n, wrong=True, max_new=N)
    rejections = N - 2  # tokens 2..N-1 are each rejected once; a wrong draft of the last token costs nothing
    assert stats.rollbacks == N - 1
    assert stats.K == N + n - 2 + (n - 1) * rejections
    assert stats.alpha == pytest.approx(1 / n, rel=0.05)
    assert stats.run_histogram() == {0: N}


def test_stats_bookkeeping():
    s = DecodeStats(n=4, N=1)
    for ok in (True, True, False, True):
        s.settle(ok)
    s.K = 9
    s.finish()
    assert s.N == 5 and s.rollbacks == 1 and s.accepted_runs == [2, 1]
    assert s.eal == pytest.approx(4 * 5 / 9)
    other = DecodeStats(n=4, N=3, K=3)
    assert pooled_eal([s, other]) == pytest.approx(4 * 8 / 12)
