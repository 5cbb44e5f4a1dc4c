"""Few rows multiplied the way this machine does fastest (spd.targets.ragged.few_rows_linear, chosen by
spd.targets.row_costs): the profile keeps the fastest product per row count and installs it, an older profile
without the choice is measured again, the prepacked product is the same product (packed again when the weight
changes) and decoding is the target's own greedy decoding under every product."""

import json
import os

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.suffix import SuffixDrafter
from spd.pricing import RowCosts
from spd.runtime.chain import ChainDecoder
from spd.targets import ragged, row_costs
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model


@pytest.fixture
def products(monkeypatch, tmp_path):
    """A fresh cache directory, and the process's choice put back afterwards."""
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ragged, "FEW_ROWS", ragged.FEW_ROWS)
    monkeypatch.setattr(ragged, "PACKED_ROWS", ragged.PACKED_ROWS)
    return tmp_path


def test_the_profile_times_every_product_and_keeps_the_fastest(products, monkeypatch):
    staged = StagedTarget(tiny_model("llama"), 1)
    ragged.FEW_ROWS = installed = frozenset({4})
    ragged.PACKED_ROWS = frozenset({5})
    timed = []
    inner = ragged.few_rows_linear

    def seen(x, weight, bias=None):
        rows = x.numel() // x.shape[-1]
        timed.append((rows, "weight_first" if rows in ragged.FEW_ROWS else
                      "packed" if rows in ragged.PACKED_ROWS else "linear"))
        return inner(x, weight, bias)
    monkeypatch.setattr(ragged, "few_rows_linear", seen)
    costs, weight_first, packed = row_costs.measure_row_costs(staged, 8, context=16, rounds=2)
    assert len(costs.seconds) == 8 and all(s > 0 for s in costs.seconds)
    assert weight_first <= set(ragged.CANDIDATES) and not weight_first & packed and 1 not in packed
    assert {(2, "weight_first"), (8, "weight_first"), (2, "packed"), (8, "packed"), (8, "linear")} <= set(timed)
    assert ragged.FEW_ROWS == installed and ragged.PACKED_ROWS == {5}   # measuring leaves the installed choice alone


def test_the_cached_choice_is_installed_and_read_back(products, monkeypatch):
    staged = StagedTarget(tiny_model("llama"), 1)
    measured = []
    monkeypatch.setattr(row_costs, "measure_row_costs",
                        lambda s, rows: measured.append(rows) or (RowCosts.flat(rows), frozenset({2, 5}),
                                                                  frozenset({6, 9})))
    assert row_costs.cached_row_costs(staged, 4) == RowCosts.flat(4)
    assert measured == [row_costs.PROFILED_ROWS]        # at least a default tree's rows are timed
    assert ragged.FEW_ROWS == {2, 5} and ragged.PACKED_ROWS == {6, 9}
    (path,) = [os.path.join(products, "row_costs", f) for f in os.listdir(os.path.join(products, "row_costs"))]
    with open(path) as f:
        saved = json.load(f)
    assert saved["weight_first"] == [2, 5] and saved["packed"] == [6, 9]
    ragged.FEW_ROWS = ragged.PACKED_ROWS = frozenset()
    assert row_costs.use_machine_products(staged) == ({2, 5}, {6, 9})     # read back, not re-measured
    assert measured == [row_costs.PROFILED_ROWS]


def test_a_profile_from_before_the_choice_is_measured_again(products, monkeypatch):
    staged = StagedTarget(tiny_model("llama"), 1)
    os.makedirs(os.path.join(products, "row_costs"))
    with open(os.path.join(products, "row_costs", f"{row_costs.machine_key(staged)}.json"), "w") as f:
        json.dump({"seconds": [1.0] * 20, "weight_first": []}, f)        # an older way of measuring
    measured = []
    monkeypatch.setattr(row_costs, "measure_row_costs",
                        lambda s, rows: measured.append(rows) or (RowCosts.flat(rows), frozenset(), frozenset({3})))
    row_costs.cached_row_costs(staged, 9)
    assert measured == [row_costs.PROFILED_ROWS] and ragged.FEW_ROWS == frozenset() and ragged.PACKED_ROWS == {3}


@pytest.mark.skipif(not ragged.PACKING, reason="this torch has no oneDNN")
def test_the_prepacked_product_is_the_product_and_follows_the_weight():
    import torch

    linear = torch.nn.Linear(24, 40)
    x = torch.randn(2, 3, 24)                                                     # 6 rows
    ragged.PACKED_ROWS, before = frozenset({6}), ragged.PACKED_ROWS
    try:
        with torch.no_grad():
            with ragged.few_rows_products():
                out = linear(x)
            assert out.shape == (2, 3, 40)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, linear.weight, linear.bias))
            first = ragged.packed_weight(linear.weight)
            assert ragged.packed_weight(linear.weight) is first                   # packed once
            linear.weight.mul_(-2.0)                                              # changed in place: packed again
            with ragged.few_rows_products():
                out = linear(x)
            assert ragged.packed_weight(linear.weight) is not first
            torch.testing.assert_close(out, torch.nn.functional.linear(x, linear.weight, linear.bias))
        assert ragged.packed_weight(linear.weight) is None                        # autograd: F.linear's product
        with ragged.few_rows_products():
            linear(x).sum().backward()
        assert linear.weight.grad is not None
        assert ragged.packed_weight(linear.weight.detach().double()) is None      # float32 only
    finally:
        ragged.PACKED_ROWS = before


PRODUCTS = [(frozenset(), frozenset()), (frozenset(ragged.CANDIDATES), frozenset())]
if ragged.PACKING:
    PRODUCTS.append((frozenset(), frozenset(range(2, 18))))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("weight_first,packed", PRODUCTS)
def test_every_product_decodes_what_ar_decodes(products, monkeypatch, family, weight_first, packed):
    """The decoder installs the machine's choice; here it is forced each way, and every verification forward
    of 2..8 rows goes through it."""
    import spd.runtime.chain as chain

    monkeypatch.setattr(chain, "use_machine_products", lambda target: None)
    ragged.FEW_ROWS, ragged.PACKED_ROWS = weight_first, packed
    calls = []
    inner = ragged.few_rows_linear

    def counted(x, weight, bias=None):
        calls.append(ragged.chosen(x.numel() // x.shape[-1]))
        return inner(x, weight, bias)
    monkeypatch.setattr(ragged, "few_rows_linear", counted)
    target = tiny_model(family)
    staged = StagedTarget(target, 1)
    p = (prompt(3, vocab=target.config.vocab_size)[:6]) * 3
    ar = ar_run(target, p, 40).token_ids
    for width in (1, 4):
        decoder = ChainDecoder(staged, SuffixDrafter(1, 4, RowCosts.flat(5)), frozenset(), 4, width=width,
                               budget=4)         # forwards of up to 5 rows
        out = decoder.generate(p, Request(40, GREEDY))
        assert out.token_ids == ar
        assert out.stats.accepted > 0                 # drafts were verified, several rows at a time
    assert any(calls) == bool(weight_first or packed)
