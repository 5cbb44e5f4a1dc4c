"""Multi-Branch Self-Drafting (spd.drafters.selfdraft): the draft branches ride in the verification forward without
changing it — greedy decodes AR's tokens on every tiny family, seeded sampling AR's keyed draws, T = 1 samples follow
the target's distribution, and the sequence's cache after every cycle (rollbacks included, a reused decoder too)
equals a fresh prefill of the verified tokens."""

from dataclasses import replace

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters import selfdraft
from spd.drafters.selfdraft import CorpusNgrams, SelfDraftDrafter, chain_drafter
from spd.spec import DecodeKeys, DecodeSpec
from spd.runtime.chain import ChainDecoder, side_rows_mask
from spd.runtime.sequence import ChainSequence
from spd.verify.sampling import SamplingParams
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from spd.verify.tree import DraftTree


def junk_corpus(vocab: int, size: int = 3) -> dict:
    """A corpus cache proposing, after every token, continuations the tiny targets mostly reject."""
    return {(t,): [tuple((t * 7 + k * 3 + j) % vocab for j in range(size)) for k in range(3)] for t in range(vocab)}


def test_branch_rows_mask_is_block_diagonal_and_sees_the_root_only():
    drafter = SelfDraftDrafter(branches=2, branch_length=3, gram=2)
    drafter.start({}, [5, 6, 7])
    drafter.branch = [[1, 2, 3], [4, 5]]
    tokens, offsets, visible = drafter.side_rows()
    assert tokens == [1, 2, 3, 4, 5] and offsets == [1, 2, 3, 1, 2]
    tree = DraftTree(9)
    tree.add(0, tree_proposal(8))
    tree.add(1, tree_proposal(7))
    full_offsets, full = side_rows_mask(tree, (tokens, offsets, visible))
    assert full_offsets.tolist() == [0, 1, 2, 1, 2, 3, 1, 2]
    want = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0, 0],
                         [1, 0, 0, 1, 0, 0, 0, 0],          # branch 1: the root, then its own rows, causal
                         [1, 0, 0, 1, 1, 0, 0, 0],
                         [1, 0, 0, 1, 1, 1, 0, 0],
                         [1, 0, 0, 0, 0, 0, 1, 0],          # branch 2: never branch 1, never the drafted nodes
                         [1, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(full, want)


def tree_proposal(token):
    from spd.verify.sampling import Proposal
    return Proposal(token, source="selfdraft")


def test_the_branch_update_and_the_context_cache():
    """Each branch appends its last row's prediction and drops its first past L; every window of G - 1 branch
    tokens and the next row's prediction is a contextual n-gram keyed by its first token, newest first."""
    drafter = SelfDraftDrafter(branches=1, branch_length=3, gram=3, candidates=4, verified_ngrams=False)
    drafter.start({}, [1, 2, 3])
    drafter.branch = [[10, 11, 12]]
    logits = torch.zeros(3, 32)
    for row, token in enumerate([20, 21, 22]):
        logits[row, token] = 1.0
    drafter.side_logits(logits)
    assert drafter.branch == [[11, 12, 22]]
    assert drafter.candidate_list(10) == [(11, 21)] and drafter.candidate_list(11) == [(12, 22)]
    drafter.corpus = CorpusNgrams({(3,): [(4, 5)], (2, 3): [(9, 9)]})
    assert drafter.candidate_list(3) == [(9, 9), (4, 5)]          # the longer prefix first
    counted = CorpusNgrams.count([1, 2, 4, 9, 1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 1, 2, 3], 3, separator=9)
    assert counted.table[(1,)] == [(2, 3), (2, 4)]           # the more frequent first; none across a separator
    assert counted.table[(1, 2)] == [(3, 1)] and (2, 4) not in counted.table


def test_the_verified_text_joins_the_context_cache():
    """verified_ngrams: the prompt's windows at the start, each cycle's new windows after its branch n-grams (newer,
    so listed first); off, the cache holds the branches' alone."""
    drafter = SelfDraftDrafter(branches=1, branch_length=3, gram=3, candidates=4)
    drafter.start({}, [1, 2, 3, 1, 2])
    assert drafter.candidate_list(1) == [(2, 3)] and drafter.candidate_list(2) == [(3, 1)]
    drafter.branch = [[1, 7, 8]]
    logits = torch.zeros(3, 32)
    logits[1, 6] = 1.0
    drafter.side_logits(logits)                                   # the branch's n-gram (1, 7, 6) ...
    drafter.observe({}, [1, 2, 3, 1, 2, 4, 1, 5])                # ... then the verified (1, 2, 4) and (1, 5) is short
    assert drafter.candidate_list(1) == [(2, 4), (7, 6), (2, 3)]
    assert drafter.grams_added == 2                               # the count is the branches' n-grams only
    off = SelfDraftDrafter(branches=1, branch_length=3, gram=3, verified_ngrams=False)
    off.start({}, [1, 2, 3, 1, 2])
    off.observe({}, [1, 2, 3, 1, 2, 4, 1, 5])
    assert off.context == {}


@pytest.mark.parametrize("branches,gram", [(6, 4), (3, 2)])
def test_selfdraft_greedy_equals_ar(family_model, untied_target_dir, branches, gram):
    """Every family's tied tiny target (loops: candidates often right) and the untied Llama (mostly wrong), with and
    without a corpus cache: AR's tokens, and drafts were kept."""
    from spd.targets.loading import load_target

    family, model = family_model
    for target in (model, load_target(untied_target_dir).model):
        staged, vocab = StagedTarget(target, 1), target.config.vocab_size
        kept = 0
        for seed in range(3):
            p = prompt(seed + 50, vocab=vocab)
            ar = ar_run(target, p, 40).token_ids
            corpus = junk_corpus(vocab, gram - 1) if seed == 2 else None
            drafter = SelfDraftDrafter(branches=branches, branch_length=4, gram=gram, corpus=corpus)
            out = ChainDecoder(staged, drafter, frozenset(), gram - 1).generate(p, Request(40, GREEDY))
            assert out.token_ids == ar, (family, seed)
            assert out.stats.N == 40 and drafter.grams_added > 0
            kept += out.stats.accepted
        if target is model:
            assert kept > 0, family


class CheckedDecoder(ChainDecoder):
    """A chain decoder whose every cycle checks the sequence's cache against a fresh prefill of the verified
    tokens (all but the newest, which the next forward feeds)."""

    def stream(self, prompt_ids, request):
        seq = ChainSequence(self.target, self.drafter, self.eos_ids, prompt_ids, request, self.m, self.width,
                            self.budget)
        self.stats, self.checked, self.rejected_cycles = seq.stats, 0, 0
        yield from seq.prefill()
        while not seq.done:
            tree = seq.draft()
            assert seq.rows is not None
            logits, captured = self.forward_tree(tree, seq.cache, seq.fed, seq.rows)
            before = len(seq.stats.verdicts)
            yield from seq.settle(logits, captured)
            self.rejected_cycles += any(not ok for _, _, ok in seq.stats.verdicts[before:])
            if not seq.done:   # the last cycle may keep the final token's row too (it is never read): every drafter's
                self.check(seq)

    def check(self, seq):
        verified = seq.tokens[:-1]
        fresh = self.target.new_cache(None)
        self.target.forward_all(torch.tensor([verified]), fresh, 0)
        for layer in range(seq.cache.num_layers):
            assert seq.cache.lengths[layer] == len(verified), (layer, seq.cache.lengths[layer], len(verified))
            keys, values = seq.cache.view(layer)
            want_k, want_v = fresh.view(layer)
            torch.testing.assert_close(keys, want_k, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(values, want_v, rtol=1e-4, atol=1e-5)
        self.checked += 1


@pytest.mark.parametrize("m", [1, 3])
def test_branch_rows_never_stay_in_the_cache(untied_target_dir, m):
    """After every cycle (chains kept contiguously and trees compacted, candidates rejected), the cache's lengths
    and K/V equal a fresh prefill of the verified tokens; a reused decoder (a second request) too."""
    from spd.targets.loading import load_target

    target = load_target(untied_target_dir).model
    vocab = target.config.vocab_size
    decoder = CheckedDecoder(StagedTarget(target, 1),
                             SelfDraftDrafter(branches=4, branch_length=3, gram=4, corpus=junk_corpus(vocab)),
                             frozenset(), m)
    outputs = []
    for seed in (60, 61, 60):
        p = prompt(seed, vocab=vocab)
        out = decoder.generate(p, Request(24, GREEDY))
        assert out.token_ids == ar_run(target, p, 24).token_ids
        assert decoder.checked >= out.stats.cycles - 1 and decoder.rejected_cycles > 0
        outputs.append((out.token_ids, out.stats.accepted, out.stats.cycles))
    assert outputs[0] == outputs[2]          # the reused decoder starts each request afresh
    # a loop (the tied target) keeps candidates: compaction of kept paths checked as well
    model = tiny_model("llama")
    decoder = CheckedDecoder(StagedTarget(model, 1), SelfDraftDrafter(branches=4, branch_length=3, gram=4),
                             frozenset(), m)
    out = decoder.generate(prompt(62, vocab=model.config.vocab_size), Request(24, GREEDY))
    assert out.stats.accepted > 0 and decoder.checked >= out.stats.cycles - 1


SAMPLED = [SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_k=0, top_p=0.9)]


@pytest.mark.parametrize("params", SAMPLED, ids=["top_k", "top_p"])
def test_sampled_selfdraft_decodes_what_keyed_ar_samples(family_model, untied_target_dir, params):
    from spd.targets.loading import load_target

    family, model = family_model
    targets = [model] + ([load_target(untied_target_dir).model] if family == "llama" else [])
    for target in targets:
        vocab = target.config.vocab_size
        kept = missed = 0
        for seed in range(3):
            p = prompt(seed + 30, vocab=vocab)
            drafter = SelfDraftDrafter(branches=4, branch_length=4, gram=3, corpus=junk_corpus(vocab, 2))
            out = ChainDecoder(StagedTarget(target, 1), drafter, frozenset(), 2).generate(p, Request(30, params, seed))
            assert out.token_ids == ar_run(target, p, 30, params, seed=seed).token_ids, (family, seed)
            kept += out.stats.accepted
            missed += sum(not ok for _, _, ok in out.stats.verdicts)
        assert missed > 0, family
        if target is model:
            assert kept > 0, family


@pytest.mark.parametrize("verified", [False, True], ids=["branches+corpus", "with-verified-ngrams"])
def test_selfdraft_samples_the_target_distribution(verified):
    """T = 1 (top-k 2, top-p 0.95: tests/test_lossless_sampling.py's PARAMS) on the 16-token 2-layer model: 2,500
    samples of 3 tokens follow the exact distribution (chi-square at ALPHA, that file's power), with candidates of
    both the branches (gram 2: a branch token and its prediction) and the corpus, kept and rejected often; with the
    verified text's n-grams too (the default), which are kept most of the time."""
    from test_lossless_sampling import ALPHA, PARAMS, SHORT, chi2_pvalue, exact_distribution, sample_chain

    model = tiny_model("llama", seed=3, num_layers=2, vocab_size=16)
    corpus = {(t,): [(2,)] for t in range(16)}      # the model mostly repeats 5: kept sometimes, rejected often
    decoder = ChainDecoder(StagedTarget(model, 1),
                           SelfDraftDrafter(branches=3, branch_length=3, gram=2, corpus=corpus, candidates=1,
                                            verified_ngrams=verified),
                           frozenset(), 1)
    verdicts = []
    counts = sample_chain(decoder, SHORT, seed=4, verdicts=verdicts)
    kept = sum(ok for _, _, ok in verdicts)
    assert kept > SHORT * 0.1 and len(verdicts) - kept > (SHORT * 0.1 if not verified else 0)
    assert chi2_pvalue(counts, exact_distribution(model, PARAMS), SHORT) > ALPHA


def test_the_factory_and_the_cli(capsys, tiny_target_dir, monkeypatch):
    """The registry's factory takes its typed options; `generate method=selfdraft` equals AR (its corpus: none
    where the datastore cannot be built, or the ShareGPT one)."""
    from spd.cli import main
    import json

    options = DecodeSpec.of(DecodeKeys(branches=2, branch_length=5, gram=3)).options["selfdraft"]
    table = CorpusNgrams({(1,): [(2, 3)]})
    monkeypatch.setattr(selfdraft, "corpus_ngrams", lambda tokenizer, vocab_size, gram: table)
    drafter = chain_drafter(selfdraft=options, tokenizer=object(), vocab_size=16)
    assert (drafter.n, drafter.length, drafter.gram, drafter.corpus) == (2, 5, 3, table)
    assert chain_drafter(selfdraft=replace(options, corpus_ngrams=False), tokenizer=object(),
                         vocab_size=16).corpus is None
    common = [f"target={tiny_target_dir}", "prompt=What is 12*7? What is 12*7?", "max_new_tokens=16", "json=true"]
    assert main(["generate", *common, "method=selfdraft", "branches=3", "branch_length=4", "corpus_ngrams=false"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "method=ar"]) == 0
    assert drafted["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert main(["generate", *common, "method=selfdraft", "gram=1"]) == 2
