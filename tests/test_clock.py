"""bench/clock.py's summary: pooled tokens/s per arm over the prompts every arm finished, ratios against AR and the
fastest plain row, τ for chains, and equality with AR read from the tokens' checksums."""

import os

import pytest

from bench.clock import by_source, hash_tokens, logged_sets, parse_arm, summarise


def rec(t, key, arm, tokens, seconds, ids, **extra):
    return {"temperature": t, "key": key, "arm": arm, "tokens": tokens, "seconds": seconds, "crc": hash_tokens(ids),
            **extra}


def test_the_summary_pools_prompts_and_reads_equality_from_checksums():
    records = [rec(0.0, "a", "ar", 10, 1.0, [1, 2]), rec(0.0, "b", "ar", 10, 2.0, [3]),
               rec(0.0, "a", "hf_generate", 10, 2.0, [1, 2]), rec(0.0, "b", "hf_generate", 10, 2.0, [3]),
               rec(0.0, "a", "fast", 10, 0.5, [1, 2], N=9, cycles=3), rec(0.0, "b", "fast", 10, 1.0, [4], N=9, cycles=6),
               rec(0.0, "c", "ar", 10, 1.0, [5])]          # c: not every arm finished it, so it is left out
    rows = {r["arm"]: r for r in summarise(records, ["ar", "hf_generate", "fast"], {"eval": ["a", "b", "c"]}, [0.0])}
    assert rows["ar"]["prompts"] == 2 and rows["ar"]["tokens_per_s"] == pytest.approx(20 / 3)
    assert rows["fast"]["vs_ar"] == pytest.approx((20 / 1.5) / (20 / 3))
    assert rows["fast"]["vs_ar_geomean"] == pytest.approx(2.0)
    assert rows["hf_generate"]["vs_fastest_plain"] == pytest.approx((20 / 4) / (20 / 3))
    assert rows["fast"]["tau"] == pytest.approx(18 / 9)
    assert rows["fast"]["equal_ar"] == 1 and rows["hf_generate"]["equal_ar"] == 2
    assert "tau" not in rows["ar"]


def test_an_arm_needs_a_label():
    assert parse_arm("default: method=suffix W=4") == ("default", "method=suffix W=4")
    with pytest.raises(SystemExit, match="label"):
        parse_arm("method=suffix")


def test_a_report_reads_the_sets_from_the_log():
    records = [rec(0.0, "mt_bench/81", "ar", 1, 1.0, [1]), rec(1.0, "mt_bench/81", "ar", 1, 1.0, [2]),
               rec(0.0, "everyday/7", "ar", 1, 1.0, [1]), rec(0.0, "gsm8k/3", "ar", 1, 1.0, [1])]
    assert logged_sets(records) == {"eval": ["mt_bench/81", "gsm8k/3"], "everyday": ["everyday/7"]}


def test_the_per_source_rows_split_the_sets_by_benchmark():
    sets = {"eval": ["mt_bench/81", "gsm8k/3", "mt_bench/82", "humaneval/HumanEval_0"], "everyday": ["everyday/7"]}
    assert by_source(sets) == {"mt_bench": ["mt_bench/81", "mt_bench/82"], "gsm8k": ["gsm8k/3"],
                               "humaneval": ["humaneval/HumanEval_0"], "everyday": ["everyday/7"]}


def test_the_summary_reads_rows_a_cycle_pricing_steps_the_worst_prompt_and_repeats():
    records = [rec(0.0, "a", "ar", 10, 1.0, [1], repeats=4), rec(0.0, "b", "ar", 10, 1.0, [2], repeats=0),
               rec(0.0, "a", "suffix", 10, 0.5, [1], N=9, cycles=3, drafted=12, drafter_cycles=3, priced_out=1),
               rec(0.0, "b", "suffix", 10, 2.0, [2], N=9, cycles=6, drafted=6, drafter_cycles=6, priced_out=2),
               rec(0.0, "a", "spd", 10, 1.0, [1], N=10, K=20), rec(0.0, "b", "spd", 10, 1.0, [9], N=10, K=5)]
    rows = {r["arm"]: r for r in summarise(records, ["ar", "suffix", "spd"], {"eval": ["a", "b"]}, [0.0])}
    assert rows["suffix"]["rows_per_cycle"] == pytest.approx(1 + 18 / 9)
    assert rows["suffix"]["priced_out_share"] == pytest.approx(3 / 9)
    assert rows["suffix"]["worst_prompt"] == "b" and rows["suffix"]["worst_prompt_vs_ar"] == pytest.approx(0.5)
    assert rows["suffix"]["prompts_under_ar"] == 1
    assert rows["spd"]["alpha"] == pytest.approx(20 / 25) and "tau" not in rows["spd"]
    assert rows["spd"]["equal_ar"] == 1
    assert rows["ar"]["repeat_share"] == pytest.approx(4 / 20) and "repeat_share" not in rows["suffix"]


class _Ticket:
    def __init__(self, tokens):
        self.tokens = tokens


class _Batch:
    """A batch decoder that answers each prompt with its own ids reversed, or with [0] for the prompt "odd"."""

    def __init__(self):
        self.submitted = []

    def submit(self, ids, request):
        self.submitted.append(request)
        return _Ticket([0] if ids == [7] else ids[::-1])

    def run(self):
        pass


class _Engine:
    def __init__(self, batches: bool):
        self.batches = batches
        self.sizes = []

    def batch_decoder(self, size):
        self.sizes.append(size)
        return _Batch() if self.batches else None

    def request(self, max_new_tokens, seed=None):
        return (max_new_tokens, seed)


def test_batched_rows_time_each_set_at_every_size_and_check_greedy_answers_against_ar():
    from bench.clock import batched

    sets = {"eval": [("p", [1, 2]), ("odd", [7])]}
    records = [rec(0.0, "p", "ar", 2, 1.0, [2, 1]), rec(0.0, "odd", "ar", 1, 1.0, [5])]
    with_batch, without = _Engine(True), _Engine(False)
    rows = batched({0.0: [("lookup", with_batch, 1), ("spd_streams", without, 1)]}, sets, [0.0], [1, 4], 16, records)
    assert [(r["arm"], r["max_batch"]) for r in rows] == [("lookup", 1), ("lookup", 4)]   # no batch decoder: no row
    assert without.sizes == [1, 4]
    assert all(r["tokens"] == 3 and r["prompts"] == 2 and r["equal_ar"] == 1 for r in rows)


def test_an_arms_leading_capitals_are_its_build_environment(monkeypatch):
    from bench.clock import arm_environment, environment

    env, keys = arm_environment("SPD_PANEL_LEVEL=avx2 method=suffix W=4")
    assert env == {"SPD_PANEL_LEVEL": "avx2"} and keys == ["method=suffix", "W=4"]
    assert arm_environment("method=ar") == ({}, ["method=ar"])
    monkeypatch.delenv("SPD_PANEL_LEVEL", raising=False)
    with environment(env):
        assert os.environ["SPD_PANEL_LEVEL"] == "avx2"
    assert "SPD_PANEL_LEVEL" not in os.environ
