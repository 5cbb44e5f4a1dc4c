"""Few rows multiplied the way this machine does fastest (spd.targets.ragged.few_rows_linear, chosen by
spd.targets.row_costs): the profile keeps the faster product per row count and installs it, an older profile
without the choice is measured again, and decoding is the target's own greedy decoding under either product."""

import json
import os

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.suffix import SuffixDrafter
from spd.pricing import RowCosts
from spd.runtime.chain import ChainDecoder
from spd.targets import panel, ragged, row_costs
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model


@pytest.fixture
def products(monkeypatch, tmp_path):
    """A fresh cache directory, and the process's choice put back afterwards."""
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(panel.PLAIN_ENV, "1")         # F.linear's products (spd.targets.panel's never call it)
    monkeypatch.setattr(ragged, "FEW_ROWS", ragged.FEW_ROWS)
    return tmp_path


def test_the_profile_times_both_products_and_keeps_the_faster(products):
    staged = StagedTarget(tiny_model("llama"), 1)
    ragged.FEW_ROWS = installed = frozenset({4})
    costs, weight_first = row_costs.measure_row_costs(staged, 8, context=16, rounds=2)
    assert len(costs.seconds) == 8 and all(s > 0 for s in costs.seconds)
    assert weight_first <= set(ragged.CANDIDATES)
    assert ragged.FEW_ROWS == installed                     # measuring leaves the installed choice alone


def test_the_cached_choice_is_installed_and_read_back(products, monkeypatch):
    staged = StagedTarget(tiny_model("llama"), 1)
    measured = []
    monkeypatch.setattr(row_costs, "measure_row_costs",
                        lambda s, rows: measured.append(rows) or (RowCosts.flat(rows), frozenset({2, 5})))
    assert row_costs.cached_row_costs(staged, 4) == RowCosts.flat(4)
    assert measured == [8]                      # at least every candidate row count is timed
    assert ragged.FEW_ROWS == {2, 5}
    (path,) = [os.path.join(products, "row_costs", f) for f in os.listdir(os.path.join(products, "row_costs"))]
    with open(path) as f:
        assert json.load(f)["weight_first"] == [2, 5]
    ragged.FEW_ROWS = frozenset()
    assert row_costs.use_machine_products(staged) == {2, 5} and measured == [8]     # read back, not re-measured


def test_a_profile_from_before_the_choice_is_measured_again(products, monkeypatch):
    staged = StagedTarget(tiny_model("llama"), 1)
    os.makedirs(os.path.join(products, "row_costs"))
    with open(os.path.join(products, "row_costs", f"{row_costs.machine_key(staged)}.json"), "w") as f:
        json.dump({"seconds": [1.0] * 16}, f)
    measured = []
    monkeypatch.setattr(row_costs, "measure_row_costs",
                        lambda s, rows: measured.append(rows) or (RowCosts.flat(rows), frozenset()))
    row_costs.cached_row_costs(staged, 9)
    assert measured == [9] and ragged.FEW_ROWS == frozenset()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("weight_first", [frozenset(), frozenset(ragged.CANDIDATES)])
def test_either_product_decodes_what_ar_decodes(products, monkeypatch, family, weight_first):
    """The decoder installs the machine's choice; here it is forced either way, and every verification forward
    of 2..8 rows goes through it."""
    import spd.runtime.chain as chain

    monkeypatch.setattr(chain, "use_machine_products", lambda target: None)
    ragged.FEW_ROWS = weight_first
    calls = []
    inner = ragged.few_rows_linear

    def counted(x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1] in weight_first)
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
    assert any(calls) == bool(weight_first)
