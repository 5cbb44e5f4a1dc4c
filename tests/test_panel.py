"""float32 products from panels (spd.targets.panel): a row's bits do not depend on the rows beside it, the values are
F.linear's up to float32 rounding, a float32 CPU target multiplies with them (and with F.linear where asked), and
drafted decoding through them is the target's own greedy decoding."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import GREEDY, priced_drafts_equal_ar
from spd.decoding import SamplingParams
from spd.targets import panel, row_costs
from spd.targets.linears import plain_products
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

pytestmark = pytest.mark.skipif(panel.extension() is None, reason="the panel kernel cannot be built here")


@pytest.mark.parametrize("d_in,d_out", [(576, 1536), (1536, 576), (37, 100), (64, 8), (130, 33)])
def test_a_row_has_the_same_bits_at_every_row_count(d_in, d_out):
    g = torch.Generator().manual_seed(d_in * d_out)
    w, x, b = torch.randn(d_out, d_in, generator=g), torch.randn(30, d_in, generator=g), torch.randn(d_out, generator=g)
    panels = panel.pack(w)
    alone = torch.cat([panel.product(x[i: i + 1], panels, d_out, b) for i in range(len(x))])
    for rows in range(2, len(x) + 1):       # every tile shape of the kernel, and the remainders after them
        assert torch.equal(panel.product(x[:rows], panels, d_out, b), alone[:rows]), rows
    exact = (x.double() @ w.double().T + b.double())
    # float32 rounding of a sum of d_in products and a bias, in any order: the classic bound gamma_n * sum |terms|
    # with gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1) — a
    # property of the dtype, not of one machine's kernels
    n, u = d_in + 1, 2.0 ** -24
    bound = n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert ((alone.double() - exact).abs() <= bound).all()
    assert panel.product(x[:0], panels, d_out, b).shape == (0, d_out)
    assert panel.product(x[:6].view(2, 3, d_in), panels, d_out, None).shape == (2, 3, d_out)


def test_the_load_check_sees_an_order_that_depends_on_the_rows(monkeypatch):
    """The check at load is the one bfloat16's products pass (invariant_attention.same_bits_at_every_row_count):
    it passes for the kernel and fails for a product that sums in another order when more rows come."""
    from spd.targets.invariant_attention import same_bits_at_every_row_count

    assert panel.panels_invariant(((576, 1536), (37, 100)))

    def by_row_count(x, w):         # the sum in reverse order once there are 4 rows or more
        x = x.float()
        return x @ w.float().T if len(x) < 4 else x.flip(1) @ w.float().flip(1).T
    assert not same_bits_at_every_row_count(576, 64, by_row_count)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_float32_cpu_target_multiplies_from_panels_unless_asked_not_to(family, monkeypatch):
    model = tiny_model(family)
    staged = StagedTarget(model, 1)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert staged.panels and linears and all(type(m) is panel.PanelLinear for m in linears)
    other = tiny_model(family)
    assert not StagedTarget(other, 1, plain_products=True).panels
    monkeypatch.setenv(panel.PLAIN_ENV, "1")
    assert not StagedTarget(other, 1).panels
    assert all(type(m) is torch.nn.Linear for m in other.modules() if isinstance(m, torch.nn.Linear))
    assert row_costs.machine_key(staged) != row_costs.machine_key(StagedTarget(other, 1))   # its own cost curve
    bf16 = tiny_model(family).to(torch.bfloat16)
    monkeypatch.delenv(panel.PLAIN_ENV)
    with warnings.catch_warnings():          # where this CPU's bfloat16 products are not row-invariant at 32 wide
        warnings.simplefilter("ignore")
        assert not StagedTarget(bf16, 1).panels


def test_a_changed_weight_is_packed_again_and_autograd_takes_f_linear():
    layer = torch.nn.Linear(40, 24)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    panel.use_panels(layer)
    x = torch.randn(5, 40)
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)
    layer.weight.mul_(-2.0)                     # in place: the panels follow
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)
    layer.weight.requires_grad_(True)
    x.requires_grad_(True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with plain_products(layer):
        assert type(layer) is torch.nn.Linear
    assert type(layer) is panel.PanelLinear


def test_without_the_kernel_targets_keep_f_linear(monkeypatch):
    monkeypatch.setattr(panel, "extension", lambda: None)
    panel.panels_invariant.cache_clear()
    try:
        model = tiny_model("llama")
        assert not StagedTarget(model, 1).panels
        assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    finally:
        panel.panels_invariant.cache_clear()


def test_the_cost_profile_of_a_panel_target_times_one_product(monkeypatch, tmp_path):
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))
    staged = StagedTarget(tiny_model("llama"), 1)
    costs, weight_first = row_costs.measure_row_costs(staged, 8, context=16, rounds=1)
    assert len(costs.seconds) == 8 and weight_first == frozenset()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, top_k=8)], ids=["greedy", "keyed T=1"])
def test_drafted_decoding_through_panels_is_the_targets_own_decoding(family, params):
    """Greedy: AR's tokens; T = 1 with a seed: AR's keyed draws — chains and priced trees of up to 13 rows (one tile of
    the kernel and a remainder), drafts kept and missed."""
    target = tiny_model(family, seed=1, tied=not params.greedy)     # untied: answers depend on the whole context
    staged = StagedTarget(target, 1)
    assert staged.panels
    kept, verified = priced_drafts_equal_ar(target, staged, params, 90)
    assert 0 < kept < verified            # drafts kept and missed
