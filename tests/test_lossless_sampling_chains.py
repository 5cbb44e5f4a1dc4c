"""Sampling is lossless for the chain decoders (draft, then one target forward): the lookup chain and its trees, and
the priced context statistics' trees — deterministic children verified by one draw of p per node, the keyed draw of
its position (spd.verify.sampling.KeyedDraws; that those draws are AR's own: tests/test_keyed_draws.py). The model, prompt,
exact distribution and the chi-square's power are tests/test_lossless_sampling.py's. With a datastore too
(spd.corpora.datastore): its children are deterministic as well."""

import pytest
import torch

from spd.drafters.base import Cycle
from spd.pricing import RowCosts
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from test_lossless_sampling import ALPHA, PARAMS, PROMPT, SHORT, chi2_pvalue, exact_distribution, sample_chain


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_model("llama", seed=3, num_layers=2, vocab_size=16)


def sample_lookup(model, samples, seed, width=1, verdicts=None, keyed=True):
    """The lookup chain (drafts copied from the context: deterministic, q = None) over PROMPT, whose one-token
    n-grams recur in the short samples; returns the counts of each sampled continuation. width > 1: its trees
    (PROMPT's "1" was followed by 4 and by 5: the root branches). verdicts: a list that receives every node's."""
    from spd.drafters.lookup import LookupDrafter
    from spd.runtime.chain import ChainDecoder

    decoder = ChainDecoder(StagedTarget(model, 1), LookupDrafter(min_n=1, max_n=2), frozenset(), 2, width,
                           8 if width > 1 else None)
    return sample_chain(decoder, samples, seed, verdicts, keyed)


@pytest.mark.slow
def test_lookup_chain_samples_the_target_distribution(small_vocab_model):
    """Point-mass drafts, verified by the keyed draw at their position (spd.verify.sampling.KeyedDraws): kept iff the draw
    is the draft, else the draw is the token."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    verdicts = []
    counts = sample_lookup(small_vocab_model, SHORT, seed=4, verdicts=verdicts)
    kept = sum(ok for _, _, ok in verdicts)
    assert kept > SHORT * 0.1 and len(verdicts) - kept > SHORT * 0.1       # both outcomes, often
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
def test_unkeyed_lookup_chain_samples_the_target_distribution(small_vocab_model, monkeypatch):
    """A request that draws from its generator, without keyed draws (test_lossless_sampling.UnkeyedRequest):
    point-mass drafts accepted with probability p(x), else the residual p without x."""
    import spd.verify.sampling

    verdicts = []
    rule = spd.verify.sampling.verify_point_mass

    def counted(draft, p, g):
        verdicts.append(rule(draft, p, g))
        return verdicts[-1]

    monkeypatch.setattr(spd.verify.sampling, "verify_point_mass", counted)
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts = sample_lookup(small_vocab_model, SHORT, seed=4, keyed=False)
    rejected = sum(not ok for ok, _ in verdicts)
    assert rejected > SHORT * 0.1 and len(verdicts) - rejected > SHORT * 0.1    # both outcomes, often
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


@pytest.mark.slow
def test_lookup_tree_samples_the_target_distribution(small_vocab_model):
    """W = 4: branching lookup candidates, deterministic, verified by one draw of p per node."""
    from spd.drafters.lookup import LookupDrafter

    drafter = LookupDrafter(min_n=1, max_n=2)
    drafter.start(None, PROMPT + [1])
    assert len(drafter.propose(Cycle(1, 2, 4, 8)).children(0)) == 2           # after a sampled "1" the root branches
    dist = exact_distribution(small_vocab_model, PARAMS)
    verdicts = []
    counts = sample_lookup(small_vocab_model, SHORT, seed=8, width=4, verdicts=verdicts)
    kept = sum(ok for _, _, ok in verdicts)
    assert kept > SHORT * 0.1 and len(verdicts) - kept > SHORT * 0.1      # nodes kept and missed, often
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


def test_a_point_mass_verifier_that_accepts_everything_is_caught(small_vocab_model, monkeypatch):
    import spd.runtime.sequence

    # the deterministic drafts' verdict (spd.verify.accept) made to keep every draft
    monkeypatch.setattr(spd.runtime.sequence, "kept_drafts", lambda drafts, choices, real=None: len(drafts))
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts = sample_lookup(small_vocab_model, 1500, seed=5)
    assert chi2_pvalue(counts, dist, 1500) < ALPHA


def sample_suffix(model, samples, seed, verdicts=None, costs=None):
    """Context statistics, priced on a CPU-like curve (2 and 3 rows dearer than 4; `costs`: another), W = 4 trees
    over PROMPT (its "1" was followed by 4 and by 5: the root branches); each sample's predictor starts from its
    prior."""
    from spd.drafters.suffix import SuffixDrafter
    from spd.runtime.chain import ChainDecoder
    from test_suffix import CPU_LIKE

    decoder = ChainDecoder(StagedTarget(model, 1), SuffixDrafter(1, 2, costs or CPU_LIKE), frozenset(), 2, 4, 8)
    return sample_chain(decoder, samples, seed, verdicts)


def test_priced_suffix_trees_sample_the_target_distribution(small_vocab_model):
    """Deterministic children, several per node, verified by one draw of p; drafts priced per cycle, each candidate
    by its own noise (with top_k = 2 the noise nearly tells the draw: the pricing drafts what will be kept)."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    verdicts = []
    counts = sample_suffix(small_vocab_model, SHORT, seed=9, verdicts=verdicts)
    kept = sum(ok for _, _, ok in verdicts)
    assert kept > SHORT * 0.5 and len(verdicts) - kept < 0.1 * kept
    assert chi2_pvalue(counts, dist, SHORT) > ALPHA


def test_a_chain_tree_verifier_that_keeps_the_first_child_is_caught(small_vocab_model, monkeypatch):
    import spd.runtime.sequence

    chain_rule, tree_rule = spd.runtime.sequence.kept_drafts, spd.runtime.sequence.kept_path

    # the verdict made to keep, where a kept node's every child missed, its first child too
    def first_of_chain(drafts, choices, real=None):
        return min(int(chain_rule(drafts, choices, real)) + 1, len(drafts))

    def first_child(tokens, chosen, real, depth, parent, ancestors):
        kept, best, path = tree_rule(tokens, chosen, real, depth, parent, ancestors)
        child = next((i for i in range(len(tokens)) if int(parent[i]) == int(best) and i), None)
        if child is None:
            return kept, best, path
        path = path.clone()
        path[int(kept) + 1] = child
        return kept + 1, torch.tensor(child), path

    monkeypatch.setattr(spd.runtime.sequence, "kept_drafts", first_of_chain)
    monkeypatch.setattr(spd.runtime.sequence, "kept_path", first_child)
    dist = exact_distribution(small_vocab_model, PARAMS)
    counts = sample_suffix(small_vocab_model, 1500, seed=10, costs=RowCosts.flat(9))   # every candidate drafted
    assert chi2_pvalue(counts, dist, 1500) < ALPHA


def test_priced_suffix_trees_with_a_datastore_sample_the_target_distribution(small_vocab_model):
    """The corpus's deterministic children beside the context's (spd.corpora.datastore), verified by one draw of p, on a
    flat curve (every candidate drafted). The corpus: the target's own samples after other prompts, so that its
    children are sometimes the draw and sometimes not."""
    from helpers import ar_run
    from spd.corpora.datastore import Datastore
    from spd.drafters.suffix import DATASTORE, Retrieval, SuffixDrafter
    from spd.runtime.chain import ChainDecoder

    samples = [ar_run(small_vocab_model, [seed % 16, (7 * seed) % 16], 12, PARAMS, seed=seed).token_ids
               for seed in range(40)]
    store = Datastore.build(samples, 16)
    drafter = SuffixDrafter(1, 2, RowCosts.flat(9), retrieval=Retrieval(store, min_n=1))
    decoder = ChainDecoder(StagedTarget(small_vocab_model, 1), drafter, frozenset(), 2, 4, 8)
    verdicts = []
    counts = sample_chain(decoder, SHORT, seed=11, verdicts=verdicts)
    kept_from_corpus = sum(ok for _, source, ok in verdicts if source == DATASTORE)
    missed = sum(not ok for _, _, ok in verdicts)        # a miss is the node's, whichever source its children came from
    assert kept_from_corpus > SHORT * 0.05 and missed > SHORT * 0.05
    assert chi2_pvalue(counts, exact_distribution(small_vocab_model, PARAMS), SHORT) > ALPHA
