"""Static KV caches and fixed-shape stage steps (what CUDA graphs capture), checked on CPU: crop, refill, equality
with the growing cache, and lossless decoding through the graph and stream executors (eager off CUDA)."""

import pytest
import torch

from helpers import GREEDY, ScriptedDrafter, ar_run, prompt
from spd.decoding import Request
from spd.decoding import prefill
from spd.drafters.spd_module import ModuleDrafter
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineARDecoder, PipelineDecoder
from spd.runtime.streams import GraphStages, StreamStages
from spd.targets.fixed_step import FixedStep
from spd.targets.kv_cache import LayerKVCache
from spd.targets.stages import StagedTarget


def test_static_cache_preallocates_crops_refills_and_refuses_overflow():
    cache = LayerKVCache(2, max_length=6)
    k = torch.randn(1, 2, 4, 3)
    keys, _ = cache.update(k, k, 0)
    buffer = cache._keys[0]
    assert buffer.shape[2] == 6 and torch.equal(keys, k) and torch.count_nonzero(buffer[:, :, 4:]) == 0
    cache.crop(2)                                   # a crop is a length change ...
    assert cache.lengths == [2, 0] and cache._keys[0] is buffer
    keys, _ = cache.update(-k, -k, 0)               # ... and a refill writes in place after it
    assert cache._keys[0] is buffer and keys.shape[2] == 6
    assert torch.equal(keys[:, :, :2], k[:, :, :2]) and torch.equal(keys[:, :, 2:], -k)
    with pytest.raises(ValueError, match="max_length=6"):
        cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert cache._keys[1] is None                   # a layer nobody wrote (another stage's) holds nothing


def test_static_cache_decodes_bitwise_like_the_growing_cache(family_model):
    _, model = family_model
    staged = StagedTarget(model, 3)
    ids = prompt(3, length=10, vocab=model.config.vocab_size)
    layers = set(range(1, staged.num_layers + 1))
    runs = []
    for max_length in (None, 40):
        cache, hidden, _ = prefill(staged, ids, max_length=max_length)
        out = [hidden[0, -1]]
        for step, token in enumerate([5, 9, 11, 7, 3]):
            if step == 3:
                cache.crop(len(ids) + 1)            # a rollback: positions past P + 1 are gone
            pos = cache.lengths[0]
            h, cap = staged.forward_all(torch.tensor([[token]]), cache, pos, layers)
            out.append(torch.cat([h[0, -1], *[cap[l][0, -1] for l in sorted(cap)]]))
        runs.append(out)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_prefill_refills_a_long_enough_static_cache_in_place(family_model):
    _, model = family_model
    staged = StagedTarget(model, 2)
    first = prompt(4, vocab=model.config.vocab_size)
    cache, _, _ = prefill(staged, first, max_length=30)
    buffers = list(cache._keys)
    again, hidden, _ = prefill(staged, prompt(5, vocab=model.config.vocab_size), max_length=20, cache=cache)
    assert again is cache and all(a is b for a, b in zip(cache._keys, buffers))
    _, fresh, _ = prefill(staged, prompt(5, vocab=model.config.vocab_size), max_length=20)
    assert torch.equal(hidden, fresh)
    longer, _, _ = prefill(staged, first, max_length=31, cache=cache)
    assert longer is not cache                      # too short: new buffers (and new graphs)


def test_fixed_step_matches_the_sliced_step(family_model):
    """The whole-buffer step under a position mask computes what the sliced step does (to rounding)."""
    _, model = family_model
    staged = StagedTarget(model, 2)
    ids = prompt(6, vocab=model.config.vocab_size)
    sliced, _, _ = prefill(staged, ids, max_length=32)
    fixed, _, _ = prefill(staged, ids, max_length=32)
    b = staged.bounds
    steps = [FixedStep(staged, b[s], b[s + 1], fixed, frozenset({b[1], b[2]}), logits=s == 1) for s in range(2)]
    P = len(ids)
    for step, (pos, token) in enumerate(zip([P, P + 1, P + 2, P + 1, P + 2], [4, 8, 15, 16, 23])):
        if step == 3:                               # rollback to P + 1, then decode over the stale rows
            sliced.crop(P + 1)
            fixed.crop(P + 1)
        h = staged.embed(torch.tensor([[token]]))
        ref, cap = staged.run_layers(h, torch.tensor([pos]), 0, staged.num_layers, sliced, {b[1]})
        mid, got_cap, _ = steps[0](h, pos)
        out, _, logits = steps[1](mid, pos)
        torch.testing.assert_close(mid, cap[b[1]], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, staged.logits(ref[0, -1]), atol=1e-4, rtol=1e-4)
        assert fixed.lengths[0] == sliced.lengths[0] == pos + 1


@pytest.mark.parametrize("executor", [GraphStages, StreamStages])
@pytest.mark.parametrize("n", [1, 3])
def test_fixed_shape_executors_decode_like_ar(family_model, executor, n):
    """Greedy SPD through the graph/stream executors equals the suite's AR through the same fixed-shape steps and
    the ordinary AR; a drafter that is right most of the time gives long accepted runs and rollbacks; the executor
    is reused across prompts (its static cache refilled)."""
    family, model = family_model
    staged = StagedTarget(model, n)
    stages = executor(staged)
    for seed in range(2):
        p = prompt(seed + 20, vocab=model.config.vocab_size)
        ar = ar_run(model, p, 30).token_ids
        fixed_ar = PipelineARDecoder(executor(StagedTarget(model, 1)), frozenset()).generate(p, Request(30, GREEDY)).token_ids
        module = SpeculationModule.from_target(staged, 1, seed=seed)
        drafter = ScriptedDrafter(ModuleDrafter(module), model, wrong_every=4) if seed else ModuleDrafter(module)
        out = PipelineDecoder(stages, drafter, frozenset()).generate(p, Request(30, GREEDY))
        assert out.token_ids == fixed_ar == ar, (family, n, seed)
        if seed and n > 1:
            assert out.stats.rollbacks > 0 and max(out.stats.run_histogram()) >= 2
