import pytest
import torch

from spd.layout import sample_occupancy
from spd.module import SpeculationModule
from spd.target.stages import StagedTarget
from spd.testing import tiny_model


def test_selector_init_passes_deepest_state_through():
    model = tiny_model("llama")
    staged = StagedTarget(model, 5)
    module = SpeculationModule.from_target(staged, 1)
    module.init_selectors()
    hidden = {l: torch.randn(1, 4, model.config.hidden_size) for l in range(11)}
    assert torch.equal(module.feature(0, hidden), hidden[0])
    for k in range(1, 6):
        torch.testing.assert_close(module.feature(k, hidden), hidden[staged.bounds[k]])


def test_layer_copy_init():
    model = tiny_model("qwen3")
    staged = StagedTarget(model, 2)
    module = SpeculationModule.from_target(staged, 2)
    module.init_layers_from([staged.layers[3], staged.layers[9]])
    for mine, theirs in zip(module.layers, [staged.layers[3], staged.layers[9]]):
        for (k, a), (_, b) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(a, b), k
    with pytest.raises(ValueError):
        module.init_layers_from([staged.layers[0]])


def test_occupancy_weights_policy():
    g = torch.Generator().manual_seed(0)
    a = sample_occupancy(20000, 4, g, weights=[0.7, 0.1, 0.1, 0.1])
    assert abs((a == 1).float().mean().item() - 0.7) < 0.02
    assert set(a.unique().tolist()) == {1, 2, 3, 4}
    with pytest.raises(ValueError):
        sample_occupancy(4, 4, g, weights=[1.0, 0.0])
