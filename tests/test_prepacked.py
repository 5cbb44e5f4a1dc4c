"""Prepacked bfloat16 products (spd.targets.prepacked): a CPU bfloat16 target whose packed product keeps a row's bits
at every row count multiplies from packed weights — the same bits as `F.linear` here, AR and drafted decoding alike —
and falls back to `F.linear` wherever the packed copy cannot serve (another dtype, autograd, a changed weight is packed
again); float32 targets are left alone; transformers' own `generate` can be timed on its own products."""

import pytest
import torch
import torch.nn.functional as F

from helpers import ar_run, prompt
from spd.decoding import Request
from spd.drafters.suffix import SuffixDrafter
from spd.runtime.chain import ChainDecoder
from spd.targets import prepacked, row_costs
from spd.targets.linears import plain_products
from spd.targets.prepacked import PrepackedLinear, packed_product
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from test_invariant_attention import bf16_model
from test_suffix import CPU_LIKE

pytestmark = pytest.mark.skipif(not prepacked.available(), reason="this torch has no oneDNN")


def test_the_packed_product_is_f_linear_bit_for_bit_here():
    g = torch.Generator().manual_seed(0)
    for d_out, d_in in [(256, 256), (64, 256), (688, 256), (256, 688)]:
        w = (torch.randn(d_out, d_in, generator=g) * 0.05).to(torch.bfloat16)
        b = torch.randn(d_out, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for rows in (1, 2, 3, 8, 17):
            x = torch.randn(1, rows, d_in, generator=g).to(torch.bfloat16)
            assert torch.equal(packed_product(x, packed, b), F.linear(x, w, b)), (d_out, d_in, rows)
    assert prepacked.packed_invariant(((256, 256), (256, 688), (688, 256)))


def test_a_bfloat16_target_is_prepacked_and_drafted_decoding_is_ar():
    model = bf16_model("llama", seed=5, tied=True)
    staged = StagedTarget(model, 1)
    assert staged.prepacked and staged.row_invariant
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PrepackedLinear for m in linears)
    assert all(prepacked.packed_weight(m) is not None for m in linears)
    decoder = ChainDecoder(staged, SuffixDrafter(1, 4, CPU_LIKE), frozenset(), 8, 4, 12)
    p = prompt(7, 15, model.config.vocab_size)
    out = decoder.generate(p, Request(40))
    assert out.token_ids == ar_run(model, p, 40).token_ids and out.stats.accepted > 10


def test_float32_is_not_prepacked():
    model = tiny_model("llama")
    staged = StagedTarget(model, 1)
    assert not staged.prepacked      # its products come from panels (tests/test_panel.py) or F.linear
    assert not any(type(m) is PrepackedLinear for m in model.modules())


def test_a_weight_changed_in_place_is_packed_again():
    model = bf16_model("qwen3", seed=6)
    StagedTarget(model, 1)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, layer.in_features).to(torch.bfloat16)
    first = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    assert torch.equal(layer(x), F.linear(x, layer.weight)) and not torch.equal(layer(x), first)


def test_other_dtypes_and_autograd_take_f_linear(monkeypatch):
    model = bf16_model("llama", seed=7)
    StagedTarget(model, 1)
    layer = model.model.layers[0].self_attn.q_proj
    called = []
    monkeypatch.setattr(prepacked, "packed_product", lambda *a: called.append(1) or packed_product(*a))
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    layer(x)
    assert called == [1]
    layer(x.clone().requires_grad_(True))                      # autograd: the packed op has no derivative
    assert called == [1]
    layer.float()
    assert layer(x.float()).dtype == torch.float32 and called == [1]


def test_plain_products_inside_packed_after():
    model = bf16_model("gemma3", seed=8)
    StagedTarget(model, 1)
    with plain_products(model):
        assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(type(m) is PrepackedLinear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_a_prepacked_target_has_its_own_row_cost_profile():
    model = bf16_model("llama", seed=9)
    staged = StagedTarget(model, 1)
    key = row_costs.machine_key(staged)
    staged.prepacked = False
    assert row_costs.machine_key(staged) != key
