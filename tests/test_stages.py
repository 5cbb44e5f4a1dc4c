"""The stage runner reproduces the target: same logits as HF, hidden states before the final norm."""

import pytest
import torch

from spd.targets.kv_cache import LayerKVCache
from spd.targets.stages import StagedTarget


def test_kv_cache_append_crop_grow():
    cache = LayerKVCache(2, initial_capacity=2)
    k = torch.randn(1, 2, 3, 4)
    keys, values = cache.update(k, k + 1, 0)
    assert keys.shape[2] == 3 and torch.equal(keys, k)
    keys, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert keys.shape[2] == 4 and torch.equal(keys[:, :, 3], k[:, :, 0])
    cache.crop(2)
    assert cache.lengths == [2, 0]
    keys, _ = cache.update(k[:, :, 2:], k[:, :, 2:], 0)
    assert keys.shape[2] == 3 and torch.equal(keys[:, :, 2], k[:, :, 2])


@pytest.mark.parametrize("n", [1, 3, 4])
def test_token_by_token_stages_match_hf_forward(family_model, n):
    family, model = family_model
    staged = StagedTarget(model, n)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        cache = staged.new_cache()
        logits, hidden_at = [], {l: [] for l in range(staged.num_layers)}
        for pos in range(ids.shape[1]):
            h = staged.embed(ids[:, pos: pos + 1])
            hidden_at[0].append(h)
            for s in range(n):
                h, cap = staged.run_stage(s, h, torch.tensor([pos]), cache, set(range(1, staged.num_layers)))
                for l, v in cap.items():
                    hidden_at[l].append(v)
            logits.append(staged.logits(h))
    torch.testing.assert_close(torch.cat(logits, 1), ref.logits, atol=1e-4, rtol=1e-4)
    # HF's hidden_states[l] for l < L is the residual stream after l layers (before the final norm).
    for l in range(staged.num_layers):
        torch.testing.assert_close(torch.cat(hidden_at[l], 1), ref.hidden_states[l], atol=1e-4, rtol=1e-4)


def test_batched_prefill_matches_incremental(family_model):
    _, model = family_model
    staged = StagedTarget(model, 2)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, cap = staged.forward_all(ids, staged.new_cache(), capture={0, 5, 10})
        cache = staged.new_cache()
        part, _ = staged.forward_all(ids[:, :10], cache)
        rest, _ = staged.forward_all(ids[:, 10:], cache, start_pos=10)
    torch.testing.assert_close(torch.cat([part, rest], 1), full, atol=1e-5, rtol=1e-5)
    assert set(cap) == {0, 5, 10}


def test_the_decoder_layers_are_called_without_a_deprecated_keyword(family_model):
    """transformers 5.24 deprecates the layers' `past_key_values=` (removed in 5.40, which pyproject's `<6` admits):
    any FutureWarning from a stage run fails here, before the keyword disappears and the cache with it."""
    import warnings

    _, model = family_model
    staged = StagedTarget(model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = staged.new_cache(16)
        hidden, _ = staged.forward_all(torch.tensor([[3, 4, 5]]), cache, 0)
        staged.forward_all(torch.tensor([[6]]), cache, 3)
    assert cache.lengths[0] == 4 and hidden.shape[1] == 3
