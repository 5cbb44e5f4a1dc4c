"""Greedy SPD equals the target's own greedy decoding token for token (and HF's generate on tiny models)."""

import warnings

import pytest
import torch

from helpers import ar_run, prompt, spd_run


@pytest.mark.parametrize("n", [2, 3, 5, 6, 10])
def test_spd_equals_ar_for_every_n(family_model, n):
    family, model = family_model
    for seed in range(2):
        p = prompt(seed)
        ar = ar_run(model, p, 40)
        spd, _, _ = spd_run(model, n, p, 40, seed=seed)
        assert spd.token_ids == ar.token_ids, (family, n, seed)
        assert spd.stats.rollbacks > 0  # a random module is wrong often: rollbacks were exercised


def test_ar_equals_hf_generate(family_model):
    family, model = family_model
    for seed in range(3):
        p = prompt(seed, length=10)
        ar = ar_run(model, p, 30)
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
        assert hf[0, len(p):].tolist() == ar.token_ids, family


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("module_layers", [1, 2])
def test_module_variants_stay_lossless(family_model, use_cache, module_layers):
    _, model = family_model
    p = prompt(7)
    ar = ar_run(model, p, 30)
    draft_vocab = torch.arange(0, model.config.vocab_size, 2)  # half the vocabulary
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spd, _, _ = spd_run(model, 5, p, 30, module_layers, use_cache, draft_vocab)
    assert spd.token_ids == ar.token_ids


def test_eos_stops_both_decoders(family_model):
    _, model = family_model
    p = prompt(3)
    free = ar_run(model, p, 30).token_ids
    eos = frozenset({free[9]})
    stop = free.index(free[9]) + 1
    ar = ar_run(model, p, 30, eos=eos)
    spd, _, _ = spd_run(model, 3, p, 30, eos=eos)
    assert ar.token_ids == free[:stop] == spd.token_ids
    assert spd.stats.N == stop


def test_uneven_and_explicit_stage_bounds(family_model):
    from spd.decoding import Request
    from spd.drafters.spd_module import ModuleDrafter
    from spd.models.module import SpeculationModule
    from spd.runtime.pipeline import PipelineDecoder
    from spd.verify.sampling import SamplingParams
    from spd.targets.stages import StagedTarget

    _, model = family_model
    p = prompt(4)
    ar = ar_run(model, p, 30)
    for n, bounds in ((4, None), (3, [1, 8])):
        staged = StagedTarget(model, n, bounds)
        module = SpeculationModule.from_target(staged, 1)
        out = PipelineDecoder(staged, ModuleDrafter(module), frozenset()).generate(p, Request(30, SamplingParams()))
        assert out.token_ids == ar.token_ids
