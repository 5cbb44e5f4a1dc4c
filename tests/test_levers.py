import pytest
import torch

from spd.layout import sample_occupancy
from spd.models.module import SpeculationModule
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model


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


def test_feature_norm_standardises_each_read_state_and_survives_a_checkpoint(tmp_path):
    from spd.models.checkpoint import load_checkpoint, save_checkpoint
    from spd.targets.loading import load_target

    loaded = load_target("tiny-llama")
    staged = StagedTarget(loaded.model, 3)
    module = SpeculationModule.from_target(staged, 1, feature_norm="standard", fc_bias=True)
    module.init_selectors()
    assert all(not fc.bias.detach().any() for fc in module.fc.values())   # a selector starts without offset
    d = loaded.model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    # a massive dimension and a large offset, as in a real residual stream
    samples = {l: torch.randn(500, d, generator=g) * (1 + l) + 3 for l in module._norm_row}
    for sample in samples.values():
        sample[:, 0] *= 400
    module.fit_feature_norm(samples)
    for layer, sample in samples.items():
        z = module.feature_input(layer, sample)
        torch.testing.assert_close(z.mean(0), torch.zeros(d), atol=1e-4, rtol=0)
        torch.testing.assert_close(z.std(0), torch.ones(d), atol=1e-4, rtol=0)
    hidden = {l: s[None, :4] for l, s in samples.items()}
    torch.testing.assert_close(module.feature(3, hidden), module.feature_input(staged.bounds[3], hidden[staged.bounds[3]]))
    for fc in module.fc.values():   # the biases travel with the checkpoint
        torch.nn.init.normal_(fc.bias)
    save_checkpoint(module, loaded, str(tmp_path / "ckpt"))
    again = load_checkpoint(str(tmp_path / "ckpt"), staged, loaded)
    assert again.feature_norm == "standard" and again.fc_bias
    for k in range(4):
        torch.testing.assert_close(again.feature(k, hidden), module.feature(k, hidden))
    with pytest.raises(ValueError, match="feature_norm"):
        SpeculationModule.from_target(staged, 1, feature_norm="layer")


def test_previous_token_init_points_head0_at_lag_one_and_leaves_content_alone():
    from spd.models.attention import memory_kv, rotate
    from spd.models.module_init import init_previous_token_head

    from transformers import AutoModelForCausalLM, LlamaConfig

    # SmolLM2's head size and RoPE base (the tiny test targets' 8-wide heads have one usable RoPE frequency)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=100000.0,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    staged = StagedTarget(model, 3)
    module = SpeculationModule.from_target(staged, 1, feature_norm="standard", fc_bias=True).eval()
    d = config.hidden_size
    g = torch.Generator().manual_seed(0)
    hidden = {l: torch.randn(1, 40, d, generator=g) * 3 + 1 for l in range(config.num_hidden_layers + 1)}
    module.fit_feature_norm({l: h[0] for l, h in hidden.items()})
    with pytest.raises(ValueError, match="fc_bias"):
        init_previous_token_head(SpeculationModule.from_target(staged, 1))
    init_previous_token_head(module)
    with torch.no_grad():
        g0, deep = module.feature(0, hidden), module.feature(3, hidden)     # [1, N, d]
        layer = module.layers[0]
        attn = layer.self_attn
        cos, sin = module.rope(torch.arange(40)[None], g0)
        k, _ = memory_kv(layer, deep, cos, sin)
        q = rotate(attn.q_proj(layer.input_layernorm(g0)).view(1, 40, -1, attn.head_dim).transpose(1, 2), cos, sin)
        scores = (q[0, 0] @ k[0, 0].T * attn.scaling).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(-1),
                                                                  float("-inf"))
        probs = scores[8:].softmax(-1)                                       # queries with 8+ rows behind them
        assert (probs.argmax(-1) == torch.arange(8, 40) - 1).all()
        assert float(probs[torch.arange(32), torch.arange(7, 39)].mean()) > 0.6
        # the bias direction carries no content: every FC output is orthogonal to it but for the bias itself
        u = module.fc["0"].bias / module.fc["0"].bias.norm()
        assert float((module.fc["3"].weight.T @ u).abs().max()) < 1e-5
