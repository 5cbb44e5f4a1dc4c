"""Lookup inside SPD's pipeline (draft_source=lookup+module): the n-gram pool takes flushed drafts back exactly,
the pipeline decodes with the hybrid exactly like AR (greedy, every tiny target family, SPD and PPSD), the lookup
really drafts and is counted per source, the fast evaluator replays the hybrid's runtime exactly, and the priced
choice between the two sources follows the request's verdicts (same output, fewer wrong lookups)."""

import random

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.hybrid import LookupThenModule
from spd.drafters.lookup import NgramIndex
from spd.drafters.reference import ReferenceDrafter
from spd.drafters.spd_module import ModuleDrafter
from spd.eval.fast import record_greedy_trace
from spd.eval.fast_trace import fast_greedy_stats
from spd.models.module import SpeculationModule
from spd.pricing import SourcePricer
from spd.runtime.pipeline import PipelineDecoder
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model


def test_truncate_restores_the_pool_a_shorter_context_builds():
    rng = random.Random(0)
    for _ in range(30):
        index = NgramIndex(1, 4)
        tokens = [rng.randrange(4) for _ in range(rng.randint(5, 40))]
        index.extend(tokens)
        keep = rng.randint(0, len(tokens))
        index.truncate(keep)
        fresh = NgramIndex(1, 4)
        fresh.extend(tokens[:keep])
        assert index.tokens == fresh.tokens and index.tables == fresh.tables
        more = [rng.randrange(4) for _ in range(5)]          # and it goes on like a pool that never saw the rest
        index.extend(more)
        fresh.extend(more)
        assert index.tables == fresh.tables and index.match() == fresh.match()


def hybrid_decoder(staged, seed, method="spd", min_n=2, priced=False):
    module = SpeculationModule.from_target(staged, 1, seed=seed, method=method).eval()
    return PipelineDecoder(staged, LookupThenModule(ModuleDrafter(module), min_n, 8, priced), frozenset())


def decode_and_count(model, n, method, priced=False):
    """Greedy hybrid decodes of three prompts, each checked against AR; {source: [verified, accepted]} pooled."""
    staged = StagedTarget(model, n)
    verified = {"lookup": [0, 0], "module": [0, 0]}
    for seed in range(3):
        p = prompt(seed + 40, vocab=model.config.vocab_size)
        decoder = hybrid_decoder(staged, seed, method, priced=priced)
        out = decoder.generate(p, Request(48, GREEDY))
        assert out.token_ids == ar_run(model, p, 48).token_ids
        for source, (v, a) in out.stats.sources.items():
            verified[source][0] += v
            verified[source][1] += a
        index = decoder.drafter.index                 # the pool holds the answer (drafts in flight after it)
        assert index.tokens[: len(p) + 48] == p + out.token_ids
        fresh = NgramIndex(2, 8)
        fresh.extend(index.tokens)
        assert index.tables == fresh.tables
    return verified


@pytest.mark.parametrize("n,method", [(2, "spd"), (3, "spd"), (3, "ppsd")])
def test_hybrid_pipeline_equals_ar_greedy(family_model, n, method):
    verified = decode_and_count(family_model[1], n, method)
    assert verified["lookup"][1] > 10 and verified["module"][0] > 0    # both sources drafted, the lookup often right


@pytest.mark.parametrize("n", [2, 3])
def test_wrong_lookup_drafts_roll_back_losslessly(n):
    """The untied tiny target's answers depend on the whole context, so some lookup drafts are wrong."""
    verified = decode_and_count(tiny_model("llama", seed=0, tied=False), n, "spd")
    assert verified["lookup"][0] > verified["lookup"][1] > 0


@pytest.mark.parametrize("n", [2, 3])
def test_priced_sources_hand_the_drafts_to_the_likelier_one(n):
    """Behind the lookup an oracle that is always right (the target's own continuation): unpriced, the lookup drafts
    wherever it matches, wrong or not; priced, once its verdicts fall behind the oracle's, the oracle drafts."""
    model = tiny_model("llama", seed=0, tied=False)
    staged = StagedTarget(model, n)
    lookups = {}
    for priced in (False, True):
        lookups[priced] = 0
        for seed in range(3):
            p = prompt(seed + 40, vocab=model.config.vocab_size)
            want = ar_run(model, p, 48).token_ids
            oracle = ReferenceDrafter(p + want, model.config.vocab_size)
            out = PipelineDecoder(staged, LookupThenModule(oracle, 2, 8, priced), frozenset()).generate(
                p, Request(48, GREEDY))
            assert out.token_ids == want
            lookups[priced] += out.stats.sources.get("lookup", [0, 0])[0]
    assert 0 < lookups[True] < lookups[False]


def test_the_source_pricer_follows_the_verdicts():
    pricer = SourcePricer()
    assert pricer.prefers_lookup(2)       # before any verdict: a two-token match drafts, as unpriced
    for pos in range(10, 30, 2):
        pricer.drafted(pos, 2)            # the lookup drafts, and is rejected ...
        pricer.drafted(pos + 1, 3)        # (drafted on a rejected token: judges nothing)
        pricer.rollback(pos)
        pricer.drafted(pos, None)         # ... the module's draft for the same place is kept
        pricer.finalize(pos)
    assert not pricer.prefers_lookup(2) and not pricer.pending
    lookup3 = pricer.predictor.counts.get(pricer.predictor.bucket(SourcePricer.lookup(3)))
    assert lookup3 is None                # the drafts on rejected tokens were never judged


@pytest.mark.parametrize("priced", [False, True])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_fast_evaluator_matches_the_hybrid_runtime(family_model, n, priced):
    _, model = family_model
    staged = StagedTarget(model, n)
    lookups = 0
    for seed in range(3):
        p = prompt(seed + 60)
        trace = record_greedy_trace(staged, p, 40, frozenset())
        module = SpeculationModule.from_target(staged, 1, seed=seed).eval()
        positions = []
        fast = fast_greedy_stats(module, trace, lookup=(2, 8), on_settle=lambda pos, *_: positions.append(pos),
                                 priced=priced)
        slow = hybrid_decoder(staged, seed, priced=priced).generate(p, Request(40, GREEDY))
        assert slow.token_ids == trace.tokens
        assert (fast["stats"].N, fast["stats"].K, fast["stats"].rollbacks) == \
            (slow.stats.N, slow.stats.K, slow.stats.rollbacks)
        assert fast["stats"].accepted_runs == slow.stats.accepted_runs
        assert fast["stats"].sources == slow.stats.sources
        assert fast["stats"].verdicts == slow.stats.verdicts        # where each accepted draft sits in the output
        assert [i + len(p) for i, _, _ in slow.stats.verdicts] == positions     # the schedule's own positions
        lookups += slow.stats.sources.get("lookup", [0, 0])[1]
    assert lookups > 0   # the comparison covered accepted lookup drafts
