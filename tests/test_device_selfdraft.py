"""Self-Draft through the device step (spd.drafters.selfdraft_device): its N × L branch rows ride in every step as
fixed rows after the tree's, updated as tensor ops, their predictions handed back in the step's one read.
The branches and the context cache evolve exactly as the host loop's (spd.runtime.chain) cycle by cycle; greedy and
keyed sampling equal AR on every family; T = 1 follows the target's distribution; the step compiles whole with
`fullgraph=True` and reads nothing back; a branch row never stays in the sequence's cache."""

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.selfdraft import SelfDraftDrafter
from spd.drafters.selfdraft_device import DeviceBranches
from spd.runtime.chain import ChainDecoder
from spd.runtime.device_chain import DeviceChainDecoder
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from test_device_step import SAMPLED, HostReads, keep_argmax_drafts
from test_lossless_sampling import ALPHA, PARAMS, SHORT, chi2_pvalue, exact_distribution, sample_chain
from test_selfdraft import junk_corpus




def drafter(vocab: int, corpus: bool = False, **options) -> SelfDraftDrafter:
    options = {"branches": 3, "branch_length": 4, "gram": 3, **options}
    return SelfDraftDrafter(corpus=junk_corpus(vocab, options["gram"] - 1) if corpus else None, **options)


def device_decoder(target, selfdraft: SelfDraftDrafter, m: int = 2, compile=None) -> DeviceChainDecoder:
    return DeviceChainDecoder(StagedTarget(target, 1), frozenset(), selfdraft, m, compile)


def test_the_branch_update_is_the_host_rule():
    """DeviceBranches.advance grows each branch to L, then shifts: the host's `(branch + [last])[-L:]`."""
    host = SelfDraftDrafter(branches=2, branch_length=3, gram=2)
    host.start({}, [7, 8, 9])
    rows = torch.zeros(6, dtype=torch.long)
    device = DeviceBranches(2, 3, torch.device("cpu"))
    device.bind(rows)
    device.start(host.side_tokens())
    for cycle in range(5):
        predicted = torch.arange(6) + 10 * (cycle + 1)                  # [N·L] a distinct guess per row
        host.side_predictions(predicted.double().tolist())
        device.advance(predicted)
        filled = int(device.filled)
        assert [row[:filled] for row in device.tokens.tolist()] == host.branch
    assert filled == 3 and host.branch[0][-1] == 50 + 2                 # the newest guess, from the last row


@pytest.mark.parametrize("corpus", [False, True], ids=["branches", "branches+corpus"])
def test_the_device_branches_and_caches_are_the_host_loops(corpus):
    """Cycle for cycle the same verdicts, the same n-grams in the context cache and the same branches as
    spd.runtime.chain's loop (a wrong row position, mask or update would change them)."""
    target = tiny_model("llama", num_layers=2)
    vocab = target.config.vocab_size
    p = prompt(31, vocab=vocab)
    on_host, on_device = drafter(vocab, corpus), drafter(vocab, corpus)
    host = ChainDecoder(StagedTarget(target, 1), on_host, frozenset(), 2).generate(p, Request(40, GREEDY))
    device = device_decoder(target, on_device)
    out = device.generate(p, Request(40, GREEDY))
    assert out.token_ids == host.token_ids == ar_run(target, p, 40).token_ids
    # the last cycle's count: the host's stops at max_new_tokens, the step's is what it verified
    assert out.stats.accepted_per_cycle[:-1] == host.stats.accepted_per_cycle[:-1]
    assert out.stats.cycles == host.stats.cycles
    assert on_device.context == on_host.context and on_device.grams_added == on_host.grams_added > 0
    filled = int(device.side.filled)
    assert [row[:filled] for row in device.side.tokens.tolist()] == on_device.branch == on_host.branch


def test_greedy_and_keyed_equal_ar(family_model, untied_target_dir):
    family, model = family_model
    kept = 0
    for target in (model, load_target(untied_target_dir).model):
        vocab = target.config.vocab_size
        for case, (params, seed) in enumerate([(GREEDY, None), (GREEDY, None), (SAMPLED, 3), (SAMPLED, 4)]):
            p = prompt(60 + case, vocab=vocab)
            device = device_decoder(target, drafter(vocab, corpus=case % 2 == 1))
            assert device.generate(p, Request(40, params, seed)).token_ids == \
                ar_run(target, p, 40, params, seed=seed).token_ids, (family, params)
            kept += device.stats.accepted
    assert kept > 0


def test_the_device_selfdraft_samples_the_target_distribution(monkeypatch):
    """T = 1 on the 16-token model, candidates from the branches and a corpus that is kept sometimes: the
    chi-square passes; keeping a node whenever it is the target's argmax is rejected by the same test."""
    model = tiny_model("llama", seed=3, num_layers=2, vocab_size=16)
    dist = exact_distribution(model, PARAMS)

    def counts(seed):
        corpus = {(t,): [(2,)] for t in range(16)}
        selfdraft = SelfDraftDrafter(branches=3, branch_length=3, gram=2, corpus=corpus, candidates=1)
        return sample_chain(device_decoder(model, selfdraft, 1), SHORT, seed=seed)
    assert chi2_pvalue(counts(4), dist, SHORT) > ALPHA
    keep_argmax_drafts(monkeypatch)
    assert chi2_pvalue(counts(5), dist, SHORT) < ALPHA


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_step_compiles_whole_and_reads_nothing_back(params, family):
    """A hybrid's branch rows follow their branch's rows through the linear-attention layers."""
    target = tiny_model(family, num_layers={"llama": 2, "qwen3_5": 4}[family])
    vocab = target.config.vocab_size
    p = prompt(5, vocab=vocab)
    request = Request(24, params, 1)
    compiled = device_decoder(target, drafter(vocab, corpus=True), compile="aot_eager")
    assert compiled.generate(p, request).token_ids == ar_run(target, p, 24, params, seed=1).token_ids
    device = device_decoder(target, drafter(vocab, corpus=True))
    device.generate(p, request)
    with HostReads() as mode:
        device.steps[max(device.steps)].run()
    assert mode.reads == []


def test_branch_rows_never_stay_in_the_cache(untied_target_dir, monkeypatch):
    """After every cycle (rejections among them) the cache's rows before the root's position equal a fresh
    prefill of the verified tokens, for a reused decoder too: the branch rows' K/V, written past the tree's, are
    never read as context."""
    target = load_target(untied_target_dir).model
    staged, vocab = StagedTarget(target, 1), target.config.vocab_size
    device = device_decoder(target, drafter(vocab, corpus=True))
    read, checked = DeviceChainDecoder.read, []

    def checked_read(self, state, host):
        values = read(self, state, host)
        fed = int(state.position)
        fresh = staged.new_cache(None)
        staged.forward_all(torch.tensor([reference[:fed]]), fresh, 0)
        for layer in range(state.cache.num_layers):
            keys, values_ = state.cache._keys[layer], state.cache._values[layer]
            want_k, want_v = fresh.view(layer)
            torch.testing.assert_close(keys[:, :, :fed], want_k, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(values_[:, :, :fed], want_v, rtol=1e-4, atol=1e-5)
        checked.append(fed)
        return values
    monkeypatch.setattr(DeviceChainDecoder, "read", checked_read)
    for seed in (70, 71, 70):
        p = prompt(seed, vocab=vocab)
        reference = p + ar_run(target, p, 40).token_ids
        out = device.generate(p, Request(24, GREEDY))
        assert p + out.token_ids == reference[: len(p) + 24]
        assert out.stats.drafted > out.stats.accepted    # rejected drafts: their rows and the branches' written, then hidden
    assert len(checked) >= 3 * 3
