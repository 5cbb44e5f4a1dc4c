import pytest
import torch

from spd.layout import depth, depth_grid, feature_layers, needed_layers, sample_occupancy, stage_bounds


def test_depth_rule_matches_paper_equations():
    n = 5
    # Steady state (Eq. 2): a = n, the last n positions step down n-1..0, everything older is depth n.
    assert [depth(9, i, n, n) for i in range(10)] == [5, 5, 5, 5, 5, 4, 3, 2, 1, 0]
    # Warm-up (Eq. 3): a = 2 -> only the newest two positions are partial.
    assert [depth(9, i, 2, n) for i in range(10)] == [5] * 8 + [1, 0]
    with pytest.raises(ValueError):
        depth(3, 4, 1, n)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_depth_grid_is_the_vectorised_rule(n):
    occupancy = torch.arange(1, n + 1)
    grid = depth_grid(12, occupancy, n)
    for b, a in enumerate(occupancy.tolist()):
        for t in range(12):
            for i in range(12):
                expected = depth(t, i, a, n) if i <= t else -1
                assert grid[b, t, i] == expected


def test_stage_bounds_even_uneven_and_explicit():
    assert stage_bounds(30, 5) == [0, 6, 12, 18, 24, 30]
    assert stage_bounds(30, 4) == [0, 8, 16, 23, 30]
    assert stage_bounds(30, 8) == [0, 4, 8, 12, 16, 20, 24, 27, 30]
    assert stage_bounds(30, 3, [5, 20]) == [0, 5, 20, 30]
    assert stage_bounds(30, 3, [0, 5, 20, 30]) == [0, 5, 20, 30]
    for bad in ([20, 5], [5], [0, 5, 40]):
        with pytest.raises(ValueError):
            stage_bounds(30, 3, bad)
    with pytest.raises(ValueError):
        stage_bounds(30, 31)


def test_feature_layers_follow_design():
    bounds = [0, 6, 12, 18, 24, 30]
    layers = feature_layers(bounds)
    assert layers[0] == (0,)
    assert layers[1:] == [(0, 3, 6), (0, 6, 12), (0, 9, 18), (0, 12, 24), (0, 15, 30)]
    assert needed_layers(bounds) == [0, 3, 6, 9, 12, 15, 18, 24, 30]
    assert feature_layers([0, 3])[1] == (0, 2, 3)  # halves round up


def test_occupancy_sampling_policy():
    g = torch.Generator().manual_seed(0)
    a = sample_occupancy(20000, 5, g)
    assert a.min() >= 1 and a.max() <= 5
    full = (a == 5).float().mean().item()
    assert abs(full - 0.5) < 0.02
    for k in range(1, 5):
        assert abs((a == k).float().mean().item() - 0.125) < 0.015
