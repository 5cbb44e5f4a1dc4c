"""SPD's pipeline through the device step (spd.runtime.device_pipeline): every stage's row, the device drafter's
draft (spd.drafters.spd_device) and the verdict in one function of device tensors. The same verdicts as the eager
pipeline (spd.runtime.pipeline) with the same module, so the same output: greedy = AR, keyed sampling = AR's keyed
draws, the target's distribution by chi-square (with its power check); compiled whole with `fullgraph=True`; no
host read inside a step."""

import pytest
import torch

from helpers import GREEDY, ar_run, prompt, spd_run
from spd.decoding import Request
from spd.drafters.spd_device import SpdDeviceDrafter
from spd.runtime.device_pipeline import DevicePipelineDecoder, DevicePipelineStep
from spd.targets.loading import load_target
from spd.targets.tiny import tiny_model
from test_device_step import SAMPLED, HostReads, answer_counts
from test_lossless_sampling import ALPHA, PARAMS, PROMPT, SHORT, chi2_pvalue, exact_distribution




@pytest.mark.parametrize("method,n", [("spd", 1), ("spd", 3), ("ppsd", 2), ("spd_output_state", 2)])
def test_the_device_pipeline_settles_as_the_eager_one(family_model, untied_target_dir, method, n):
    """Greedy: AR's tokens, and the eager pipeline's verdicts one by one (the same module drafts the same tokens
    from the same rows); keyed sampling: AR's keyed draws."""
    family, model = family_model
    for target in (model, load_target(untied_target_dir).model):
        p = prompt(n + 20, vocab=target.config.vocab_size)
        eager, staged, module = spd_run(target, n, p, 30, method=method)
        device = DevicePipelineDecoder(staged, module, frozenset())
        assert device.generate(p, Request(30, GREEDY)).token_ids == ar_run(target, p, 30).token_ids, family
        assert device.stats.verdicts == eager.stats.verdicts and device.stats.rollbacks == eager.stats.rollbacks
        assert device.generate(p, Request(30, SAMPLED, 7)).token_ids == \
            ar_run(target, p, 30, SAMPLED, seed=7).token_ids, family


@pytest.mark.parametrize("n", [2, 3])
def test_the_lookup_in_front_of_the_module_settles_as_the_eager_one(family_model, untied_target_dir, n):
    """draft_source=lookup+module through the device step: the lookup's token where the context matched earlier
    (handed to the step from the host), else the module's — the eager hybrid's verdicts one by one, AR's tokens,
    and AR's keyed draws; the repeating prompt makes the lookup draft and its drafts kept."""
    from spd.drafters.hybrid import LookupThenModule
    from spd.drafters.spd_module import ModuleDrafter
    from spd.runtime.pipeline import PipelineDecoder

    family, model = family_model
    kept = 0
    for target in (model, load_target(untied_target_dir).model):
        p = prompt(n + 30, vocab=target.config.vocab_size, length=8) * 3
        _, staged, module = spd_run(target, n, p, 1)
        eager = PipelineDecoder(staged, LookupThenModule(ModuleDrafter(module), 2, 8), frozenset())
        expected = eager.generate(p, Request(40, GREEDY))
        device = DevicePipelineDecoder(staged, module, frozenset(), lookup=(2, 8))
        assert device.generate(p, Request(40, GREEDY)).token_ids == ar_run(target, p, 40).token_ids == \
            expected.token_ids, family
        assert device.stats.verdicts == eager.stats.verdicts and device.stats.rollbacks == eager.stats.rollbacks
        kept += sum(held for _, _, held in device.stats.verdicts)
        assert device.generate(p, Request(40, SAMPLED, 7)).token_ids == \
            ar_run(target, p, 40, SAMPLED, seed=7).token_ids, family
    assert kept > 5


def test_drafts_are_kept():
    """A module whose drafts the target keeps (the output-state plan at n = 3 on the tiny Llama): the held path."""
    target = tiny_model("llama")
    p = prompt(3, vocab=target.config.vocab_size)
    eager, staged, module = spd_run(target, 3, p, 30, method="spd_output_state")
    device = DevicePipelineDecoder(staged, module, frozenset())
    assert device.generate(p, Request(30, GREEDY)).token_ids == eager.token_ids
    assert device.stats.verdicts == eager.stats.verdicts
    assert sum(kept for _, _, kept in device.stats.verdicts) > 5


def pipeline_counts(model, samples: int, seed: int, monkeypatch) -> dict:
    """Sampled answers of SPD's device pipeline (n = 2) whose module always drafts token 5, PROMPT's likeliest
    continuation here, so drafts are often kept (and often the argmax without being the draw)."""
    eager, staged, module = spd_run(model, 2, PROMPT, 1)
    monkeypatch.setattr(SpdDeviceDrafter, "module_draft", lambda self, view: torch.tensor([5]))
    return answer_counts(DevicePipelineDecoder(staged, module, frozenset()), samples, seed)


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_model("llama", seed=3, num_layers=2, vocab_size=16)


def test_the_pipeline_samples_the_target_distribution(small_vocab_model, monkeypatch):
    """T = 1 with top-k and top-p: the chi-square passes; a verdict that keeps a draft whenever it is the target's
    argmax (not the keyed draw) is rejected by the same test."""
    dist = exact_distribution(small_vocab_model, PARAMS)
    assert chi2_pvalue(pipeline_counts(small_vocab_model, SHORT, 31, monkeypatch), dist, SHORT) > ALPHA

    def argmax_keeps(logits, chosen, candidate):
        held = (chosen == candidate)[0] | (logits.argmax(-1) == candidate)[0]
        return held, torch.where(held, candidate, chosen)
    monkeypatch.setattr(DevicePipelineStep, "settle", staticmethod(argmax_keeps))
    assert chi2_pvalue(pipeline_counts(small_vocab_model, SHORT, 32, monkeypatch), dist, SHORT) < ALPHA


@pytest.mark.parametrize("lookup", [None, (2, 8)], ids=["module", "lookup+module"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_step_compiles_whole_and_reads_nothing_back(params, lookup, family):
    """A hybrid's stages too: each stage's linear-attention row reads the states after the position before it."""
    target = tiny_model(family, num_layers=4)
    p = prompt(5, vocab=target.config.vocab_size) * 2
    eager, staged, module = spd_run(target, 3, p, 1)
    request = Request(24, params, 1)
    compiled = DevicePipelineDecoder(staged, module, frozenset(), compile="aot_eager", lookup=lookup)
    assert compiled.generate(p, request).token_ids == ar_run(target, p, 24, params, seed=1).token_ids
    device = DevicePipelineDecoder(staged, module, frozenset(), lookup=lookup)
    device.generate(p, request)
    with HostReads() as mode:
        device.step.run()
    assert mode.reads == []
