"""Self-Draft's branches as a priced source of the context statistics (spd.drafters.suffix_branches): their n-grams
join the candidates as a source of their own, the branch rows ride only where the pricing says they pay, and
decoding with them is the target's own — greedy = AR on every tiny family, keyed sampling = AR's keyed draws, T = 1
samples follow the target's distribution, and a branch row never stays in the sequence's cache."""

import random

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.drafters.base import Cycle
from spd.decoding import Request
from spd.drafters.selfdraft import DraftBranches
from spd.drafters.suffix import SuffixDrafter
from spd.drafters.suffix_branches import BRANCHES, SuffixBranchesDrafter
from spd.pricing import RowCosts, choose, choose_beside
from spd.runtime.chain import ChainDecoder
from spd.verify.sampling import SamplingParams
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

FREE = RowCosts.flat(64)          # rows cost nothing: every branch rides every cycle


def drafter_with(costs=FREE, branches=4, length=4, gram=3, **kwargs) -> SuffixBranchesDrafter:
    return SuffixBranchesDrafter(DraftBranches(branches, length, gram), 1, 4, costs, **kwargs)


def test_choose_beside_is_choose_without_side_rows():
    rng = random.Random(0)
    for _ in range(200):
        reach = sorted((rng.random() for _ in range(rng.randrange(0, 12))), reverse=True)
        costs = RowCosts(tuple(1.0 + rng.random() * r * 0.3 for r in range(rng.randrange(1, 16))))
        edge = rng.choice([0.0, 0.1])
        assert choose_beside(reach, costs, edge)[:2] == (choose(reach, costs, edge), 0)


def test_side_rows_ride_where_they_pay():
    rising = RowCosts(tuple(1.0 + 0.1 * r for r in range(40)))
    # worth more than they cost: all; worth nothing: none; past the measured curve: never offered
    assert choose_beside([0.9], rising, 0.0, (0, 4, 8), value=0.5)[:2] == (1, 2)
    assert choose_beside([0.9], rising, 0.0, (0, 4, 8), value=0.0)[:2] == (1, 0)
    assert choose_beside([0.9], RowCosts.flat(6), 0.0, (0, 4, 8), value=1.0)[:2] == (1, 1)
    # a CPU curve where 4 rows cost less than 3: the free room goes to side rows of any worth
    dip = RowCosts((1.0, 1.6, 1.9, 1.46))
    assert choose_beside([0.9], dip, 0.0, (0, 2), value=0.01)[:2] == (1, 1)


def test_branch_ngrams_are_candidates_of_their_own_source():
    """The n-grams keyed by the newest token merge into a trie weighted by how often the branches produced them,
    under first tokens the context did not propose, and carry the source "branches"."""
    drafter = drafter_with()
    drafter.start(None, [5, 1, 2, 3, 9, 1])
    for gram in ([1, 2, 4], [1, 7, 8], [1, 7, 8], [1, 7, 6], [3, 3, 3]):
        drafter.lanes.remember(gram)
    nodes, evidence = drafter.candidates(m=3, width=4, budget=12)
    context = [n.token for n, e in zip(nodes, evidence) if n.parent < 0 and e.source == "suffix"]
    branch = {n.token: e for n, e in zip(nodes, evidence) if n.parent < 0 and e.source == BRANCHES}
    assert context == [2] and set(branch) == {7}            # 1 -> 2 came from the context: the branches' 2 is left out
    assert branch[7].share == pytest.approx(3 / 4) and branch[7].support == pytest.approx(4)   # of every n-gram of 1
    below = {nodes[i].token: evidence[i].share for i in range(len(nodes)) if evidence[i].source == BRANCHES
             and nodes[i].parent >= 0}
    assert below == {8: pytest.approx(2 / 3), 6: pytest.approx(1 / 3)}
    assert all(n.parent < i for i, n in enumerate(nodes))


def test_the_pricing_runs_branches_only_where_they_pay():
    tokens = [5, 1, 2, 3, 9, 1]
    free = drafter_with(FREE)
    free.start(None, tokens)
    free.propose(Cycle(tokens[-1], 4, 4, 12))
    assert free.plan == [0, 1, 2, 3] and free.side_rows() is not None
    dear = drafter_with(RowCosts(tuple(1.0 + 0.5 * r for r in range(40))))     # a row costs half a forward
    dear.start(None, tokens)
    dear.propose(Cycle(tokens[-1], 4, 4, 12))
    assert dear.plan == [] and dear.side_rows() is None
    # rows a little dearer than free: they ride while their prior value holds, and stop once the request shows
    # they earn nothing
    cheap = drafter_with(RowCosts(tuple(1.0 + 0.005 * r for r in range(40))), prior_rows=4.0)
    cheap.start(None, tokens)
    cheap.propose(Cycle(tokens[-1], 4, 4, 12))
    assert cheap.plan
    cheap.rows += 400
    cheap.propose(Cycle(tokens[-1], 4, 4, 12))
    assert cheap.plan == []


def test_branches_least_recently_run_ride_first():
    drafter = drafter_with(RowCosts((1.0, 1.0, 1.0, 1.0, 5.0, 5.0)), branches=3, length=2)   # room for 3 rows
    tokens = [4, 5, 6, 7]
    drafter.start(None, tokens)
    ridden = []
    for _ in range(3):
        drafter.propose(Cycle(tokens[-1], 4, 4, 12))
        ridden.append(list(drafter.plan))
    assert ridden == [[0, 1, 2], [0, 1, 2], [0, 1, 2]]      # one token each: all fit
    drafter.lanes.branch = [[1, 2], [3, 4], [5, 6]]
    drafter.propose(Cycle(tokens[-1], 4, 4, 12))
    first = list(drafter.plan)
    drafter.propose(Cycle(tokens[-1], 4, 4, 12))
    assert first == [0] and drafter.plan == [1]              # two rows each: one a cycle, in turn


@pytest.mark.parametrize("costs", [None, FREE, RowCosts(tuple(1.0 + 0.02 * r for r in range(64)))],
                         ids=["unpriced", "free", "rising"])
def test_greedy_with_branches_decodes_what_ar_decodes(family_model, untied_target_dir, costs):
    from spd.targets.loading import load_target

    family, model = family_model
    ran = kept = 0
    for target in (model, load_target(untied_target_dir).model):
        drafter = drafter_with(costs)
        decoder = ChainDecoder(StagedTarget(target, 1), drafter, frozenset(), 8, 3, 12)
        for seed in range(3):               # one drafter for all: each request restarts its branches
            p = prompt(seed + 90, vocab=target.config.vocab_size)
            out = decoder.generate(p, Request(40, GREEDY))
            assert out.token_ids == ar_run(target, p, 40).token_ids, (family, seed)
            kept += out.stats.sources.get(BRANCHES, [0, 0])[1]
        ran += drafter.branch_rows
    assert ran > 0
    if costs is FREE and family == "llama":
        assert kept > 0                     # the untied target's branch n-grams are kept


SAMPLED = [SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_k=0, top_p=0.9)]


@pytest.mark.parametrize("params", SAMPLED, ids=["top_k", "top_p"])
def test_sampled_with_branches_decodes_what_keyed_ar_samples(family_model, untied_target_dir, params):
    from spd.targets.loading import load_target

    family, model = family_model
    targets = [model] + ([load_target(untied_target_dir).model] if family == "llama" else [])
    for target in targets:
        judged = 0
        for seed in range(3):
            p = prompt(seed + 30, vocab=target.config.vocab_size)
            drafter = drafter_with(FREE)
            out = ChainDecoder(StagedTarget(target, 1), drafter, frozenset(), 4, 3, 9).generate(
                p, Request(30, params, seed))
            assert out.token_ids == ar_run(target, p, 30, params, seed=seed).token_ids, (family, seed)
            assert drafter.branch_rows > 0
            judged += sum(out.stats.sources.get(BRANCHES, [0, 0])[:1])
        if target is not model:
            assert judged > 0


def test_with_branches_samples_the_target_distribution():
    """T = 1 (top-k 2, top-p 0.95: tests/test_lossless_sampling.py's PARAMS) on the 16-token 2-layer model: 2,500
    samples of 3 tokens follow the exact distribution (chi-square at ALPHA, that file's power), every cycle with
    branch rows beside the tree and the branches' candidates drafted, kept and rejected."""
    from test_lossless_sampling import ALPHA, PARAMS, SHORT, chi2_pvalue, exact_distribution, sample_chain

    model = tiny_model("llama", seed=3, num_layers=2, vocab_size=16)
    # matches of 5 tokens at least: the short context proposes nothing, so every candidate is the branches'
    drafter = SuffixBranchesDrafter(DraftBranches(6, 3, 2), 5, 8, FREE)
    decoder = ChainDecoder(StagedTarget(model, 1), drafter, frozenset(), 2, 3, 6)
    verdicts = []
    counts = sample_chain(decoder, SHORT, seed=4, verdicts=verdicts)
    from_branches = [ok for _, source, ok in verdicts if source == BRANCHES]
    assert sum(from_branches) > 50 and len(from_branches) - sum(from_branches) > 50
    assert drafter.branch_rows > SHORT
    assert chi2_pvalue(counts, exact_distribution(model, PARAMS), SHORT) > ALPHA


@pytest.mark.parametrize("m,width,budget", [(1, 1, None), (3, 3, 9)])
def test_branch_rows_never_stay_in_the_cache(untied_target_dir, m, width, budget):
    """After every cycle (chains kept contiguously and trees compacted, candidates rejected), the cache's lengths
    and K/V equal a fresh prefill of the verified tokens; a reused decoder (a second request) too."""
    from spd.targets.loading import load_target
    from test_selfdraft import CheckedDecoder

    target = load_target(untied_target_dir).model
    decoder = CheckedDecoder(StagedTarget(target, 1), drafter_with(FREE), frozenset(), m, width, budget)
    outputs = []
    for seed in (60, 61, 60):
        p = prompt(seed, vocab=target.config.vocab_size)
        out = decoder.generate(p, Request(24, GREEDY))
        assert out.token_ids == ar_run(target, p, 24).token_ids
        assert decoder.checked >= out.stats.cycles - 1 and decoder.rejected_cycles > 0
        outputs.append((out.token_ids, out.stats.accepted, out.stats.cycles))
    assert outputs[0] == outputs[2]          # the reused decoder starts each request afresh


def test_a_decoder_without_side_rows_leaves_the_branches_idle(untied_target_dir):
    """The batched decoder runs no side rows: the drafter turns its branches off after the first cycle and decodes
    what the plain priced drafter does — AR's tokens."""
    from spd.engine import build_batch_decoder
    from spd.methods import CHAIN
    from spd.targets.loading import load_target

    target = load_target(untied_target_dir).model
    staged = StagedTarget(target, 1)
    drafters = []

    def make():
        drafters.append(drafter_with(FREE))
        return drafters[-1]

    decoder = build_batch_decoder(CHAIN, staged, frozenset(), make, max_batch=2, draft_length=4)
    p = prompt(70, vocab=target.config.vocab_size)
    ticket = decoder.submit(p, Request(24, GREEDY))
    decoder.run()
    assert ticket.tokens == ar_run(target, p, 24).token_ids
    assert drafters and not drafters[0].runs_side_rows and drafters[0].branch_rows == 0


def test_the_factory_the_eval_harness_and_the_cli(capsys, tiny_target_dir):
    """suffix_branches=true builds the branched drafter from the selfdraft keys; eval runs it step by step (a greedy
    trace holds no branch row's logits); `generate method=suffix suffix_branches=true` equals AR."""
    import json

    from spd.cli import main
    from spd.drafters.suffix import chain_drafter
    from spd.eval.harness import uses_fast_evaluator
    from spd.spec import DecodeKeys, DecodeSpec
    from types import SimpleNamespace

    spec = DecodeSpec.of(DecodeKeys(suffix_branches=True, branches=3, branch_length=5, gram=3))
    drafter = chain_drafter(lookup=spec.lookup, suffix=spec.suffix, selfdraft=spec.options["selfdraft"], row_costs=None,
                            memory=None, retrieval=None)
    assert isinstance(drafter, SuffixBranchesDrafter)
    assert (drafter.lanes.n, drafter.lanes.length, drafter.lanes.gram, drafter.extra_rows) == (3, 5, 3, 15)
    plain = DecodeSpec.of(DecodeKeys())
    assert type(chain_drafter(lookup=plain.lookup, suffix=plain.suffix, selfdraft=plain.options["selfdraft"], row_costs=None,
                              memory=None, retrieval=None)) is SuffixDrafter
    from spd.config import load_config
    from spd.eval.config import EvalConfig

    keys = ["method=suffix", "temperature=0", "W=4"]
    assert uses_fast_evaluator(load_config(EvalConfig, None, [*keys, "suffix_branches=false"]))
    assert not uses_fast_evaluator(load_config(EvalConfig, None, [*keys, "suffix_branches=true"]))
    common = [f"target={tiny_target_dir}", "prompt=What is 12*7? What is 12*7?", "max_new_tokens=16", "json=true"]
    assert main(["generate", *common, "method=suffix", "W=4", "suffix_branches=true", "branches=3",
                 "branch_length=4"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "method=ar"]) == 0
    assert drafted["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
