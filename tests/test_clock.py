"""bench/clock.py's summary: pooled tokens/s per arm over the prompts every arm finished, ratios against AR and the
fastest plain row, τ for chains, and equality with AR read from the tokens' checksums."""

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
