"""float32 products from panels (spd.targets.panel): at every ISA level this CPU runs, a row's bits do not depend on
the rows beside it and the values are F.linear's up to float32 rounding; the self-check refuses a level that breaks
the rule; a float32 CPU target multiplies with them (and with F.linear where asked), and drafted decoding through them
is the target's own greedy decoding, at every level."""

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
# every level this CPU executes: an AVX-512 machine proves the AVX2 and portable levels too
LEVELS = panel.levels() if panel.extension() is not None else ()


def test_the_cpu_runs_the_portable_level_and_what_its_isa_promises():
    capability = torch.backends.cpu.get_cpu_capability()        # torch's own reading of the CPU: AVX512, AVX2, ...
    assert LEVELS[0] == "portable"
    assert "avx2" in LEVELS or capability not in ("AVX2", "AVX512")
    assert "avx512" in LEVELS or capability != "AVX512"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("d_in,d_out", [(576, 1536), (1536, 576), (37, 100), (64, 8), (130, 33)])
def test_a_row_has_the_same_bits_at_every_row_count(d_in, d_out, level):
    g = torch.Generator().manual_seed(d_in * d_out)
    w, x, b = torch.randn(d_out, d_in, generator=g), torch.randn(30, d_in, generator=g), torch.randn(d_out, generator=g)
    panels = panel.pack(w, level)
    alone = torch.cat([panel.product(x[i: i + 1], panels, d_out, b, level) for i in range(len(x))])
    for rows in range(2, len(x) + 1):       # every tile shape of the kernel, and the remainders after them
        assert torch.equal(panel.product(x[:rows], panels, d_out, b, level), alone[:rows]), rows
    exact = (x.double() @ w.double().T + b.double())
    # float32 rounding of a sum of d_in products and a bias, in any order: the classic bound gamma_n * sum |terms|
    # with gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1) — a
    # property of the dtype, not of one machine's kernels
    n, u = d_in + 1, 2.0 ** -24
    bound = n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert ((alone.double() - exact).abs() <= bound).all()
    assert panel.product(x[:0], panels, d_out, b, level).shape == (0, d_out)
    assert panel.product(x[:6].view(2, 3, d_in), panels, d_out, None, level).shape == (2, 3, d_out)


def _by_row_count(real):
    """A product that sums in reverse order once there are 4 rows or more: a kernel that breaks the rule."""
    def product(x, panels, n_out, bias, level):
        if x.reshape(-1, x.shape[-1]).shape[0] < 4:
            return real(x, panels, n_out, bias, level)
        return real(x.flip(-1), panel.pack(panels.permute(0, 2, 1).reshape(-1, x.shape[-1])[:n_out].flip(1),
                                             level), n_out, bias, level)
    return product


def test_the_self_check_passes_the_kernel_and_refuses_a_level_that_breaks_the_rule(monkeypatch, tmp_path):
    """The check at start-up is the one bfloat16's products pass (invariant_attention.same_bits_at_every_row_count):
    it passes the kernel at every level, fails a product whose order changes with the rows, falls back to the next
    level that passes, and keeps its verdicts on disk for the next start."""
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))
    panel.panels_invariant.cache_clear()
    shapes = ((576, 1536), (37, 100))
    try:
        assert all(panel.panels_invariant(shapes, level) for level in LEVELS)
        assert panel.level_for(shapes) == LEVELS[-1]
        assert list((tmp_path / "panel_checks").glob("*.json"))        # kept for the next process
        panel.panels_invariant.cache_clear()
        monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path / "fresh"))
        real = panel.product
        broken = LEVELS[-1]
        monkeypatch.setattr(panel, "product", lambda x, p, n, b, level: (_by_row_count(real) if level == broken
                                                                          else real)(x, p, n, b, level))
        assert not panel.panels_invariant(shapes, broken)
        assert panel.level_for(shapes) == (LEVELS[-2] if len(LEVELS) > 1 else None)
        monkeypatch.setenv(panel.LEVEL_ENV, broken)                    # asked for: refused, not used inexactly
        assert panel.level_for(shapes) is None
        model = tiny_model("llama")
        staged = StagedTarget(model, 1)
        assert not staged.panels and not staged.exact_rows
    finally:
        panel.panels_invariant.cache_clear()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_float32_cpu_target_multiplies_from_panels_unless_asked_not_to(family, monkeypatch):
    model = tiny_model(family)
    staged = StagedTarget(model, 1)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert staged.panels and linears and all(type(m) is panel.PanelLinear for m in linears)
    assert staged.panel_level == LEVELS[-1] and staged.exact_rows
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
    panel.use_panels(layer, LEVELS[-1])
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


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, top_k=8)], ids=["greedy", "keyed T=1"])
def test_drafted_decoding_through_panels_is_the_targets_own_decoding(family, params, level, monkeypatch):
    """Greedy: AR's tokens; T = 1 with a seed: AR's keyed draws — chains and priced trees of up to 13 rows (one tile of
    the kernel and a remainder), drafts kept and missed — at every level."""
    monkeypatch.setenv(panel.LEVEL_ENV, level)
    target = tiny_model(family, seed=1, tied=not params.greedy)     # untied: answers depend on the whole context
    staged = StagedTarget(target, 1)
    assert staged.panels and staged.panel_level == level
    kept, verified = priced_drafts_equal_ar(target, staged, params, 90)
    assert 0 < kept < verified            # drafts kept and missed


def test_a_session_refuses_drafted_decoding_where_no_level_passes_and_ar_still_runs(monkeypatch):
    """The self-check's verdict reaches the user: no level passed, so a drafted method is refused in one line before it
    could decode inexactly, and AR — exact at any row count, it runs one row — still opens."""
    from spd.config import GenerateConfig, load_config
    from spd.errors import UserError
    from spd.session import open_session

    monkeypatch.setattr(panel, "level_for", lambda shapes: None)
    with pytest.raises(UserError, match="method=lookup: this CPU's float32 products give a row other bits"):
        open_session(load_config(GenerateConfig, None, ["target=tiny-llama", "method=lookup"]))
    assert not open_session(load_config(GenerateConfig, None, ["target=tiny-llama", "method=ar"])).staged.panels
