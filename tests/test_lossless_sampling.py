"""Sampling is lossless: the sampled continuations of SPD, PPSD, the output-state ablation, the lookup inside SPD's
pipeline (lookup+module), EAGLE-3's chain and tree, PipeDec and FlowSpec follow the target's (warped) distribution
(the lookup chain and the priced statistics: tests/test_lossless_sampling_chains.py, with this file's helpers).

Power: with 2,500 samples a chi-square test at p < 1e-3 rejects a distribution shifted by 5% total variation in the
direction hardest to see (proportional to p) at least 18 times out of 20 — checked below, so the tests can fail (the
hardest such shift, all of the mass moved between the likeliest continuation and the three others, is rejected 95%
of the time over 300 draws; 4,000 samples, the earlier setting, rejected it every time). The broken verifiers below are caught with 1,000–1,500 samples.
(At 12,000–30,000 samples, for power against 2–3.5%, these tests would take a third of the suite's time. The
warped target has four continuations here, so a shift of every one in the same direction is no shift at all: the
power check draws only real shifts.)
"""


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spd.decoding import Request
from spd.drafters.hybrid import LookupThenModule
from spd.drafters.spd_module import ModuleDrafter
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineDecoder
from spd.verify.sampling import SamplingParams, verify_sampled, warp
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

PARAMS = SamplingParams(temperature=1.0, top_k=2, top_p=0.95)
PROMPT = [3, 1, 4, 1, 5]
LENGTH = 3          # generated tokens per sample: the first from the prefill, two through verification
SHORT = 2500        # >= 90% power against a 5% TV shift at ALPHA (checked below)
ALPHA = 1e-3


def exact_distribution(model, params):
    """P(x_1..x_LENGTH | prompt) under the warped target, enumerated over the warped support."""
    dist = {(): 1.0}
    for _ in range(LENGTH):
        nxt = {}
        for prefix, mass in dist.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            probs = warp(logits, params)
            for tok in torch.nonzero(probs).flatten().tolist():
                nxt[prefix + (tok,)] = mass * float(probs[tok])
        dist = nxt
    return dist


def chi2_pvalue(counts: dict, dist: dict, total: int) -> float:
    outcomes = sorted(dist)
    observed = np.array([counts.get(o, 0) for o in outcomes], dtype=float)
    expected = np.array([dist[o] for o in outcomes]) * total
    outside = total - observed.sum()  # samples outside the target's support are an immediate failure
    if outside > 0:
        return 0.0
    small = expected < 5  # pool sparse bins so the chi-square approximation holds
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    expected *= observed.sum() / expected.sum()
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_model("llama", seed=3, num_layers=2, vocab_size=16)


def sample_spd(model, n, samples, seed, method="spd", lookup=False, sources=None, width=1, extra=None, priced=False,
               pipedec=None, flowspec=None):
    """lookup: draft_source=lookup+module, matching one-token suffixes (PROMPT's tokens recur in the samples).
    sources: a dict that receives {source: [verified, accepted]} pooled over the samples. width: W (trees);
    extra: a list that receives, per sample, the rows stage 1 ran beyond one per step (a tree's branching);
    priced: the lookup drafts where the request's verdicts predict it likelier kept than the module. pipedec:
    (children, draft layers) of PipeDec's tree, drafted by another random model of the vocabulary (the target's
    own early exit is nearly always right here), instead of the module. flowspec: (segment, depth, budget) of
    FlowSpec's segments, its trees W wide grown from the target's logits plus noise."""
    staged = StagedTarget(model, n)
    if flowspec:
        from spd.runtime.segments import SegmentPipelineDecoder
        from test_flowspec import NoisyTargetTrees

        segment, depth, budget = flowspec
        decoder = SegmentPipelineDecoder(staged, NoisyTargetTrees(model, 2.0), frozenset(), segment, depth, width,
                                         budget)
    elif pipedec:
        from spd.drafters.draft_model import DraftLM, DraftModelDrafter

        children, layers = pipedec
        other = StagedTarget(tiny_model("llama", seed=4, num_layers=2, vocab_size=16), 1)
        decoder = PipelineDecoder(staged, DraftModelDrafter(DraftLM(other, layers)), frozenset(), width, children,
                                  spine=False)
    else:
        module = SpeculationModule.from_target(staged, 1, seed=1, method=method)  # random: its q is far from p, rejections are common
        drafter = ModuleDrafter(module)
        decoder = PipelineDecoder(staged, LookupThenModule(drafter, 1, 2, priced) if lookup else drafter,
                                  frozenset(), width)
    counts, rollbacks = {}, 0
    for i in range(samples):
        out = decoder.generate(PROMPT, Request(LENGTH, PARAMS, seed * 1_000_003 + i))
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        rollbacks += out.stats.rollbacks
        if extra is not None:
            extra.append(out.stats.stage_rows[0] - out.stats.K)
        for source, (verified, accepted) in out.stats.sources.items():
            if sources is not None:
                total = sources.setdefault(source, [0, 0])
                total[0] += verified
                total[1] += accepted
    return counts, rollbacks


@pytest.mark.parametrize("samples,tv", [(SHORT, 0.05)])
def test_chi_square_detects_a_small_shift(small_vocab_model, samples, tv):
    dist = exact_distribution(small_vocab_model, PARAMS)
    outcomes = sorted(dist)
    p = np.array([dist[o] for o in outcomes])
    rng = np.random.default_rng(0)
    rejected = 0
    for trial in range(20):
        signs = np.ones(p.size)
        while abs(signs.sum()) == p.size:   # all one sign scales p by a constant: after normalising, no shift
            signs = rng.choice([-1.0, 1.0], size=p.size)
        shifted = p * (1 + 0.1 * signs)
        shifted /= shifted.sum()
        # scale the perturbation to exactly `tv` total variation
        direction = shifted - p
        shifted = p + direction * (tv / (0.5 * np.abs(direction).sum()))
        assert shifted.min() >= 0
        draws = rng.multinomial(samples, shifted)
        counts = {o: int(c) for o, c in zip(outcomes, draws)}
        rejected += chi2_pvalue(counts, dist, samples) < ALPHA
    assert rejected >= 18


def test_spd_sampling_matches_target_distribution(small_vocab_model):
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts, rollbacks = sample_spd(small_vocab_model, n=2, samples=SHORT, seed=0)
    assert rollbacks > SHORT * 0.2  # the residual-resampling path was exercised heavily
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


def test_a_broken_verifier_is_caught(small_vocab_model, monkeypatch):
    """Accepting every draft (sampling from q, not p) must fail the same test."""
    import spd.verify.sampling

    monkeypatch.setattr(spd.verify.sampling, "verify_sampled", lambda draft, p, q, g: (True, draft))
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts, _ = sample_spd(small_vocab_model, n=2, samples=1500, seed=1)
    assert chi2_pvalue(counts, dist, 1500) < ALPHA


def test_rejection_rule_output_is_exactly_p():
    """Analytic check of one verification: P(out=x) = q(x) min(1, p/q) + P(reject) * residual(x) = p(x)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = warp(torch.randn(12, generator=g) * 2, PARAMS)
        q = warp(torch.randn(12, generator=g) * 2, SamplingParams(1.0, 5, 0.9))
        accept = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q.clamp(min=1e-30)), torch.zeros_like(p))
        residual = (p - q).clamp(min=0)
        reject_mass = 1 - (q * accept).sum()
        out = q * accept + reject_mass * residual / residual.sum()
        torch.testing.assert_close(out, p, atol=1e-6, rtol=1e-5)
    # and the implementation follows that rule: a draft with p(x) = 0 is never accepted
    p = torch.tensor([0.0, 1.0]); q = torch.tensor([1.0, 0.0])
    assert verify_sampled(0, p, q, g) == (False, 1)


@pytest.mark.slow   # PPSD's drafter runs after the step (the output-state ablation's plan runs the same loop path)
@pytest.mark.parametrize("method", ["ppsd"])
def test_after_step_drafters_sample_the_target_distribution(small_vocab_model, method):
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts, rollbacks = sample_spd(small_vocab_model, n=2, samples=SHORT, seed=2, method=method)
    assert rollbacks > SHORT * 0.2
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("m", [3])   # a rejection at any of 3 drafts, or all accepted and the bonus token
def test_eagle3_chain_samples_the_target_distribution(small_vocab_model, m):
    from spd.drafters.eagle3 import Eagle3Drafter
    from spd.models.eagle3 import Eagle3Module
    from spd.runtime.chain import ChainDecoder

    dist = exact_distribution(small_vocab_model, PARAMS)
    staged = StagedTarget(small_vocab_model, 1)
    module = Eagle3Module.from_target(staged, seed=1).eval()
    decoder = ChainDecoder(staged, Eagle3Drafter(module, staged.embed), frozenset(), m)
    counts, rejected_cycles = {}, 0
    for i in range(SHORT):
        out = decoder.generate(PROMPT, Request(LENGTH, PARAMS, 3 * 1_000_003 + i))
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        rejected_cycles += sum(a < m for a in out.stats.accepted_per_cycle)
    assert rejected_cycles > SHORT * 0.2
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
def test_eagle3_tree_samples_the_target_distribution(small_vocab_model):
    """W = 4: the dynamic tree's deterministic top-4 children, verified by one draw of p per node."""
    from spd.drafters.eagle3 import Eagle3Drafter
    from spd.models.eagle3 import Eagle3Module
    from spd.runtime.chain import ChainDecoder

    dist = exact_distribution(small_vocab_model, PARAMS)
    staged = StagedTarget(small_vocab_model, 1)
    module = Eagle3Module.from_target(staged, seed=1).eval()
    decoder = ChainDecoder(staged, Eagle3Drafter(module, staged.embed), frozenset(), 3, width=4, budget=8)
    counts, missed, branched = {}, 0, 0
    for i in range(SHORT):
        out = decoder.generate(PROMPT, Request(LENGTH, PARAMS, 5 * 1_000_003 + i))
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        missed += sum(not ok for _, _, ok in out.stats.verdicts)
        branched += out.stats.drafted > 3 * out.stats.cycles        # more nodes than a chain of 3 could hold
    assert missed > SHORT * 0.1 and branched == SHORT     # misses happen; every cycle drafted a real tree
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("priced", [False, True])
def test_lookup_inside_the_pipeline_samples_the_target_distribution(small_vocab_model, priced):
    """draft_source=lookup+module at n = 2: point-mass lookup drafts and the module's sampled drafts in one
    pipeline; priced, which of the two drafts follows the request's own sampled verdicts."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    sources = {}
    counts, rollbacks = sample_spd(small_vocab_model, n=2, samples=SHORT, seed=6, lookup=True, sources=sources,
                                   priced=priced)
    verified, accepted = sources["lookup"]
    assert accepted > SHORT * 0.1 and verified - accepted > SHORT * 0.1      # lookup drafts kept and rejected, often
    assert sources["module"][0] > SHORT * 0.1
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
def test_pipeline_trees_sample_the_target_distribution(small_vocab_model):
    """W = 4 in SPD's pipeline: each tip's top-4 children are deterministic, verified by one draw of p at the
    exiting node; a kept child keeps its subtree in every stage (PPSD's trees run the same loop)."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    extra = []
    counts, rollbacks = sample_spd(small_vocab_model, n=2, samples=SHORT, seed=9, width=4,
                                   extra=extra)
    assert rollbacks > SHORT * 0.1 and sum(e > 0 for e in extra) > SHORT * 0.5    # misses, and real trees
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("width, children", [(1, 1), (4, 2)])
def test_pipedec_samples_the_target_distribution(small_vocab_model, width, children):
    """PipeDec: a draft model's c likeliest children per tip, the w best by
    cumulative log q in flight, a kept child's subtree kept in every stage and the draft model's cache; W = 1: its
    sampled draft, verified by rejection against its q."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    sources, extra = {}, []
    counts, rollbacks = sample_spd(small_vocab_model, n=2, samples=SHORT, seed=13, width=width, sources=sources,
                                   extra=extra, pipedec=(children, 1))
    verified, accepted = sources["draft_model"]
    assert accepted > SHORT * 0.1 and rollbacks > SHORT * 0.1                   # kept and corrected
    assert width == 1 or sum(e > 0 for e in extra) > SHORT * 0.5                # real trees
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
def test_flowspec_samples_the_target_distribution(small_vocab_model):
    """FlowSpec: segments of 2 nodes of trees 2 wide and 3 deep in a 2-stage pipeline; an exiting segment's one draw
    of p per node continues the walk, a kept child prunes the segments in flight and waiting, a miss flushes."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    sources, extra = {}, []
    counts, rollbacks = sample_spd(small_vocab_model, n=2, samples=SHORT, seed=15, width=2, sources=sources,
                                   extra=extra, flowspec=(2, 3, 8))
    verified, accepted = sources["noisy"]
    assert accepted > SHORT * 0.1 and rollbacks > SHORT * 0.1                   # kept and corrected
    assert sum(e > 0 for e in extra) > SHORT * 0.5                             # segments of several nodes
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


def test_a_flowspec_verifier_that_keeps_the_first_child_is_caught(small_vocab_model, monkeypatch):
    import spd.runtime.segments

    monkeypatch.setattr(spd.runtime.segments, "settle_children", lambda logits, children, params, g: (0, children[0].token))
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts, _ = sample_spd(small_vocab_model, n=2, samples=1000, seed=16, width=2, flowspec=(2, 3, 8))
    assert chi2_pvalue(counts, dist, 1000) < ALPHA


def test_a_pipedec_verifier_that_keeps_the_first_child_is_caught(small_vocab_model, monkeypatch):
    import spd.runtime.pipeline

    monkeypatch.setattr(spd.runtime.pipeline, "settle_children", lambda logits, children, params, g: (0, children[0].token))
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts, _ = sample_spd(small_vocab_model, n=2, samples=1000, seed=14, width=4, pipedec=(2, 1))
    assert chi2_pvalue(counts, dist, 1000) < ALPHA


@pytest.mark.slow
def test_lookup_module_trees_sample_the_target_distribution(small_vocab_model):
    """draft_source=lookup+module at W = 4: a tip whose branch ends in a match gets the lookup's one point-mass
    child, the others the module's top-4; one rule verifies both kinds of node."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    sources, extra = {}, []
    counts, rollbacks = sample_spd(small_vocab_model, n=2, samples=SHORT, seed=11, lookup=True, sources=sources,
                                   width=4, extra=extra)
    verified, accepted = sources["lookup"]
    assert accepted > SHORT * 0.1 and verified - accepted > SHORT * 0.1      # lookup children kept and rejected
    assert sources["module"][0] > SHORT * 0.1 and sum(e > 0 for e in extra) > SHORT * 0.1   # and real trees
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


def test_a_tree_verifier_that_keeps_the_first_child_is_caught(small_vocab_model, monkeypatch):
    import spd.runtime.pipeline

    monkeypatch.setattr(spd.runtime.pipeline, "settle_children", lambda logits, children, params, g: (0, children[0].token))
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts, _ = sample_spd(small_vocab_model, n=2, samples=1000, seed=10, width=4)
    assert chi2_pvalue(counts, dist, 1000) < ALPHA


def test_a_lookup_in_the_pipeline_that_is_always_kept_is_caught(small_vocab_model, monkeypatch):
    import spd.verify.sampling

    monkeypatch.setattr(spd.verify.sampling, "verify_point_mass", lambda draft, p, g: (True, draft))
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts, _ = sample_spd(small_vocab_model, n=2, samples=1500, seed=7, lookup=True)
    assert chi2_pvalue(counts, dist, 1500) < ALPHA


class UnkeyedRequest(Request):
    """A sampled request without keyed draws: a chain's deterministic drafts meet the point-mass rule
    (spd.verify.sampling.verify_point_mass, SPD's pipeline's rule for a lookup draft), drawing from the generator."""

    def draws(self, generator, vocab):
        return None


def sample_chain(decoder, samples, seed, verdicts=None, keyed=True):
    """Counts of each sampled continuation of PROMPT by a chain decoder; verdicts receives every node's. keyed:
    False draws from the request's generator (`UnkeyedRequest`)."""
    counts = {}
    for i in range(samples):
        request = (Request if keyed else UnkeyedRequest)(LENGTH, PARAMS, seed * 1_000_003 + i)
        out = decoder.generate(PROMPT, request)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        if verdicts is not None:
            verdicts += out.stats.verdicts
    return counts
