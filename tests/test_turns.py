"""The benchmarks time their rows taking turns on each prompt (bench/turns.py): every
row decodes every prompt, the order rotates one place per prompt (so no row always runs first, after a warm-up or a
cold cache), and each row's totals are its own prompts' results."""

from spd.decoding import GenerationResult
from spd.metrics import ChainStats

from bench.turns import decode_all, decode_interleaved


def test_rows_take_turns_and_keep_their_own_totals():
    prompts = [(f"p{i}", [i]) for i in range(4)]
    calls = []

    def run_of(name: str, seconds: float, tokens: int):
        def run(key, ids):
            calls.append((key, name))
            return GenerationResult([ids[0]] * tokens, seconds)
        return run

    runs = [run_of("a", 1.0, 2), run_of("b", 0.5, 3), run_of("c", 0.25, 4)]
    a, b, c = decode_interleaved(prompts, runs)
    order = [[name for key, name in calls if key == k] for k, _ in prompts]
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert (a["tokens"], a["seconds"], a["tokens_per_s"]) == (8, 4.0, 2.0)
    assert (b["tokens"], b["tokens_per_s"]) == (12, 6.0)
    assert c["outputs"] == {f"p{i}": [i] * 4 for i in range(4)}
    assert c["per_prompt_tokens_per_s"] == {f"p{i}": 16.0 for i in range(4)}
    assert decode_all(prompts, run_of("a", 1.0, 2)) == a     # the same totals as one row timed alone


def test_chain_rows_keep_tau_and_rows_per_cycle():
    def run(key, ids):
        stats = ChainStats(m=7, N=7, cycles=3, drafted=6, sources={"suffix": (6, 3)})
        return GenerationResult([1] * 6, 1.0, stats)

    (row,) = decode_interleaved([("p0", [0]), ("p1", [1])], [run])
    assert row["tau"] == (6 + 6) / 6 and row["rows_per_cycle"] == 1 + 12 / 6
    assert row["sources"] == {"suffix": {"verified": 12, "accepted": 6, "acceptance": 0.5}}
