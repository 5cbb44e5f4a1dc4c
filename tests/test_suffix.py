"""Context statistics, priced (method=suffix): its candidates carry the context's counts, the pricing picks the
row count that pays on the machine's curve and learns from verdicts, and decoding with it — chain, tree, any
pricing, with or without the cross-request memory — is the target's own greedy decoding; the one replay settles
what the runtime settles."""

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.drafters.base import Cycle
from spd.decoding import Request
from spd.drafters.suffix import SuffixDrafter, SuffixMemory
from spd.eval.fast import record_greedy_trace
from spd.eval.fast_chain import fast_tree_stats
from spd.pricing import AcceptancePredictor, Evidence, RowCosts, choose
from spd.runtime.chain import ChainDecoder
from spd.targets.stages import StagedTarget

# a CPU's curve: 2 and 3 rows cost more than 4 (docs/speed-cpu.md, "The lookup chain's settings")
CPU_LIKE = RowCosts((1.0, 1.6, 1.9, 1.46, 1.9, 2.0, 2.1, 1.57, 2.2, 2.3, 2.4, 2.0, 2.6, 2.7, 2.8, 1.84))


def test_candidates_carry_the_counts_of_what_followed():
    drafter = SuffixDrafter(1, 4)
    drafter.start(None, [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2])
    nodes, evidence = drafter.candidates(m=2, width=4, budget=8)
    first = {nodes[i].token: evidence[i] for i in range(len(nodes)) if nodes[i].parent < 0}
    assert set(first) == {3, 4}                              # "1 2" was followed by 3 twice and by 4 once
    assert first[3].share == pytest.approx(2 / 3) and first[4].share == pytest.approx(1 / 3)
    assert first[3].match == 2 and first[3].support == pytest.approx(3)
    below_3 = {nodes[i].token: evidence[i].share for i in range(len(nodes)) if nodes[i].parent == 0}
    assert below_3 == {9: 0.5, 8: 0.5}                       # then 9 once, 8 once
    assert nodes[0].token == 3                               # best first
    assert all(n.parent < i for i, n in enumerate(nodes))    # parents first
    assert len(drafter.candidates(m=2, width=1, budget=8)[0]) == 2      # W = 1: one chain


def test_pricing_picks_the_row_count_that_pays():
    assert choose([], CPU_LIKE) == 0
    assert choose([0.01] * 15, CPU_LIKE) == 0                # nothing likely: a plain AR step
    # one likely draft is worth 2 rows, but 4 rows cost less than 2: fill them with the next-best candidates
    assert choose([0.9, 0.05, 0.05, 0.05], CPU_LIKE) == 3
    assert choose([0.95] * 15, CPU_LIKE) == 15               # a long sure run: the whole budget
    assert choose([0.9, 0.05], RowCosts.flat(16)) == 2       # free rows: everything
    assert choose([0.9] * 3, RowCosts((1.0, 2.5, 3.5, 4.5))) == 0        # rows that cost more than they bring


def test_a_draft_must_beat_the_plain_step_by_the_edge():
    costs = RowCosts((1.0, 1.2))
    assert choose([0.3], costs) == 1                         # 1.3 tokens for 1.2: 8% faster than a plain step
    assert choose([0.3], costs, edge=0.1) == 0               # not by the 10% asked
    assert choose([0.5], costs, edge=0.1) == 1


def test_the_predictor_learns_from_verdicts():
    predictor = AcceptancePredictor()
    sure = Evidence("suffix", 4, 1.0, 3, 1, margin=2.0)
    before = predictor.predict(sure)
    assert predictor.predict(Evidence("suffix", 1, 1.0, 3, 1, margin=2.0)) < before     # a shorter match: less
    for _ in range(40):
        predictor.observe(sure, False)
    assert predictor.predict(sure) < 0.1 < before
    # another bucket has no verdicts of its own, but the request's calibration (pooled) moved it down ...
    other = Evidence("suffix", 8, 1.0, 3, 1, margin=2.0)
    assert predictor.predict(sure) < predictor.predict(other) < 0.5 * before
    # ... where the target was as sure; at another margin it keeps its prior
    sure_there = Evidence("suffix", 8, 1.0, 3, 1, margin=9.0)
    assert predictor.predict(sure_there) == pytest.approx(AcceptancePredictor().predict(sure_there))


def test_a_priced_out_candidate_is_still_judged():
    drafter = SuffixDrafter(1, 4, RowCosts((1.0, 50.0, 50.0)))      # drafting never pays
    tokens = [5, 1, 2, 3, 9, 1, 2]
    drafter.start(None, tokens)
    assert len(drafter.propose(Cycle(tokens[-1], 2, 1, 2))) == 1          # a plain step
    drafter.observe({}, tokens + [3])                                # the target chose what "1 2" had continued with
    assert drafter.priced_out == 1
    assert sum(kept for kept, _ in drafter.predictor.counts.values()) == 1   # the undrafted candidate's verdict


@pytest.mark.parametrize("width,budget,costs", [(1, None, None), (1, None, CPU_LIKE), (3, 12, CPU_LIKE),
                                                (4, 15, RowCosts.flat(16))])
def test_greedy_suffix_decodes_what_ar_decodes(family_model, untied_target_dir, width, budget, costs):
    from spd.targets.loading import load_target

    family, model = family_model
    drafted = 0
    for target in (model, load_target(untied_target_dir).model):
        staged = StagedTarget(target, 1)
        drafter = SuffixDrafter(1, 4, costs)
        decoder = ChainDecoder(staged, drafter, frozenset(), 8, width, budget)
        for seed in range(3):               # one drafter for all (each request restarts its predictor)
            p = prompt(seed + 90, vocab=target.config.vocab_size)
            out = decoder.generate(p, Request(40, GREEDY))
            assert out.token_ids == ar_run(target, p, 40).token_ids, (family, seed)
            drafted += out.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("width,budget", [(1, None), (3, 12)])
def test_the_replay_settles_what_the_runtime_settles(family_model, width, budget):
    _, model = family_model
    staged = StagedTarget(model, 1)
    for seed in range(3):
        p = prompt(seed + 150, vocab=model.config.vocab_size)
        runtime, replayed = MarginLog(1, 4, CPU_LIKE), MarginLog(1, 4, CPU_LIKE)
        out = ChainDecoder(staged, runtime, frozenset(), 8, width, budget).generate(p, Request(40, GREEDY))
        trace = record_greedy_trace(staged, p, 40, frozenset())
        got = fast_tree_stats(replayed, trace, 8, width, budget or 8)
        want = out.stats
        assert (got["stats"].N, got["stats"].cycles, got["stats"].accepted_per_cycle, got["stats"].verdicts) == \
            (want.N, want.cycles, want.accepted_per_cycle, want.verdicts)
        assert sum(got["rows_per_cycle"]) == want.drafted + want.cycles
        # the target's confidence each cycle, as the runtime measured it and as the trace recorded it
        assert len(runtime.margins) == want.cycles
        assert runtime.margins == pytest.approx(replayed.margins, abs=1e-4)


class MarginLog(SuffixDrafter):
    """The suffix drafter, keeping every margin it was told."""

    def start(self, prompt_hidden, tokens):
        super().start(prompt_hidden, tokens)
        self.margins = []

    def propose(self, cycle, choose=None):
        self.margins.append(cycle.margin)
        return super().propose(cycle, choose)


def test_the_memory_changes_speed_not_output(untied_target_dir):
    """A second request that repeats the first: with the memory its first drafts come from the earlier request
    and are kept (and its predictor starts from the first request's verdicts); the tokens are AR's either way."""
    from spd.targets.loading import load_target

    target = load_target(untied_target_dir).model
    staged = StagedTarget(target, 1)
    p = prompt(7, vocab=target.config.vocab_size)[:12]
    ar = ar_run(target, p, 40).token_ids
    runs = {}
    for memory in (None, SuffixMemory(1, 4)):
        decoder = ChainDecoder(staged, SuffixDrafter(1, 4, None, memory), frozenset(), 8)
        decoder.generate(p, Request(40, GREEDY))
        out = decoder.generate(p, Request(40, GREEDY))
        assert out.token_ids == ar
        runs[memory is not None] = out.stats
    assert runs[True].accepted > runs[False].accepted
    assert runs[True].accepted_per_cycle[0] > 0 == runs[False].accepted_per_cycle[0]


def test_the_row_cost_profile_is_measured_once_per_machine(tmp_path, monkeypatch):
    from spd.targets import row_costs
    from spd.targets.tiny import tiny_model

    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))
    staged = StagedTarget(tiny_model("llama"), 1)
    first = row_costs.cached_row_costs(staged, 6)
    assert len(first.seconds) == 6 and all(s > 0 for s in first.seconds)
    measured = []
    monkeypatch.setattr(row_costs, "measure_row_costs",
                        lambda *a, **k: measured.append(a) or (RowCosts.flat(9), frozenset({3})))
    assert row_costs.cached_row_costs(staged, 4).seconds == first.seconds[:4]    # read back, not re-measured
    assert not measured
    assert row_costs.cached_row_costs(staged, 9) == RowCosts.flat(9) and measured      # longer: measured again


@pytest.mark.parametrize("max_batch", [1, 3])
def test_generate_with_the_memory_decodes_what_ar_decodes(capsys, tiny_target_dir, tmp_path, max_batch):
    """spd-infer generate method=suffix suffix_memory=true over a prompts file that repeats itself: every answer is
    AR's, one at a time (one drafter, the memory of the earlier requests) and batched (a drafter per request, one
    memory for the session)."""
    import json

    from spd.cli import main

    prompts = ["Count to five.", "Say hi.", "Count to five.", "Count to five."]
    common = [f"target={tiny_target_dir}", "max_new_tokens=24"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    assert main(["generate", *common, "method=ar", f"prompts_file={path}", "max_batch=1"]) == 0
    ar = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert main(["generate", *common, "method=suffix", "suffix_memory=true", "W=4", f"prompts_file={path}",
                 f"max_batch={max_batch}"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in records] == ar and all(r["method"] == "suffix" for r in records)
