"""Grouped query heads packed as rows (spd.targets.gqa_attention): the kernel is transformers' SDPA up to float32
rounding for every mask it meets, CPU targets with grouped heads attend with it (and with transformers' SDPA where
asked), and drafted decoding through it — chains, trees, several sequences in one forward — is the target's own."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from helpers import GREEDY, priced_drafts_equal_ar, prompt
from spd.decoding import SamplingParams
from spd.targets import gqa_attention, row_costs
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_config, tiny_model


class Module(torch.nn.Module):
    """What the kernels read off an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def tree_mask(t: int, s: int) -> torch.Tensor:
    """[1, 1, t, s] bool: the cache before the rows, then two branches among the rows."""
    rows = torch.tril(torch.ones(t, t, dtype=torch.bool))
    rows[t // 2:, 1: t // 2] = False
    return torch.cat([torch.ones(t, s - t, dtype=torch.bool), rows], 1).view(1, 1, t, s)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (8, 1)])
@pytest.mark.parametrize("t", [2, 5, 13])
def test_the_kernel_is_transformers_sdpa_up_to_rounding(heads, kv_heads, t):
    g = torch.Generator().manual_seed(heads * 100 + t)
    s, d = 40, 16
    q = torch.randn(1, heads, t, d, generator=g)
    k, v = torch.randn(1, kv_heads, s, d, generator=g), torch.randn(1, kv_heads, s, d, generator=g)
    module = Module(heads // kv_heads)
    mask = tree_mask(t, s)
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    for given in (mask, additive, gqa_attention.pack_mask(mask, heads // kv_heads)):
        got, _ = gqa_attention.packed_gqa_attention(module, q, k, v, given, scaling=0.25)
        assert got.shape == want.shape == (1, t, heads, d)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a row's values do not depend on its branch's sibling: hiding a row from the others changes only what it sees
    hidden = mask.clone()
    hidden[0, 0, -1, -2] = False
    got, _ = gqa_attention.packed_gqa_attention(module, q, k, v, hidden, scaling=0.25)
    torch.testing.assert_close(got[:, :-1], want[:, :-1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got[:, -1], want[:, -1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mask_packed_additive_once_gives_the_boolean_masks_bits(dtype):
    """SDPA turns a boolean mask into 0 / -inf in every layer; packed once a forward in the queries' dtype, the
    kernel's output keeps every bit (a row's whole output, sibling branches and the cache included)."""
    g = torch.Generator().manual_seed(7)
    t, s, d = 6, 33, 16
    q = torch.randn(1, 9, t, d, generator=g).to(dtype)
    k, v = torch.randn(1, 3, s, d, generator=g).to(dtype), torch.randn(1, 3, s, d, generator=g).to(dtype)
    mask = tree_mask(t, s)
    additive = gqa_attention.pack_mask(mask, 3, dtype)
    assert additive.dtype == dtype and additive.shape == (1, 1, 3 * t, s)
    assert torch.equal(additive == 0, gqa_attention.pack_mask(mask, 3)) and additive.min() == float("-inf")
    want, _ = gqa_attention.packed_gqa_attention(Module(3), q, k, v, gqa_attention.pack_mask(mask, 3), scaling=0.25)
    got, _ = gqa_attention.packed_gqa_attention(Module(3), q, k, v, additive, scaling=0.25)
    assert torch.equal(got, want)
    assert torch.equal(gqa_attention.pack_mask(additive, 3, dtype), additive.repeat(1, 1, 3, 1))   # additive stays


def test_a_forward_with_the_packed_additive_mask_is_the_boolean_ones_bit_for_bit(monkeypatch):
    staged = StagedTarget(tiny_model("llama"), 1)
    ids = torch.tensor([prompt(4, length=24)])
    cache = staged.new_cache()
    staged.forward_all(ids[:, :16], cache, 0)
    visible = tree_mask(8, 8)[0, 0]

    def rows():
        chain, _ = staged.forward_all(ids[:, 16:24], cache, 16)
        cache.crop(16)
        tree, _ = staged.forward_all(ids[:, 16:24], cache, 16, offsets=visible.sum(1) - 1, visible=visible)
        cache.crop(16)
        return staged.logits(chain[0]), staged.logits(tree[0])

    additive = rows()
    monkeypatch.setattr(gqa_attention, "pack_mask", lambda mask, groups, dtype=None: mask.repeat(1, 1, groups, 1))
    boolean = rows()
    assert all(torch.equal(a, b) for a, b in zip(additive, boolean))


def test_one_row_and_a_fresh_causal_pass_are_transformers_own_path():
    g = torch.Generator().manual_seed(0)
    module = Module(3)
    k, v = torch.randn(1, 3, 20, 8, generator=g), torch.randn(1, 3, 20, 8, generator=g)
    for q, mask in [(torch.randn(1, 9, 1, 8, generator=g), None),
                    (torch.randn(1, 9, 1, 8, generator=g), torch.ones(1, 1, 1, 20, dtype=torch.bool)),
                    (torch.randn(1, 9, 20, 8, generator=g), None)]:
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.5)
        got, _ = gqa_attention.packed_gqa_attention(module, q, k, v, mask, scaling=0.5)
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_cpu_gqa_target_attends_with_it_unless_asked_not_to(family):
    staged = StagedTarget(tiny_model(family), 1)
    assert staged.packed_gqa and staged.config._attn_implementation == gqa_attention.KERNEL
    plain = StagedTarget(tiny_model(family), 1, plain_attention=True)
    assert not plain.packed_gqa and plain.config._attn_implementation == "sdpa"
    assert row_costs.machine_key(staged) != row_costs.machine_key(plain)      # its own cost curve
    again = StagedTarget(staged.model, 1)            # a second StagedTarget over the same model: the same choice
    assert again.packed_gqa and row_costs.machine_key(again) == row_costs.machine_key(staged)
    assert not StagedTarget(staged.model, 1, plain_attention=True).packed_gqa
    assert staged.config._attn_implementation == "sdpa"
    config = tiny_config(family)
    config.num_key_value_heads = config.num_attention_heads                    # no grouped heads: nothing to pack
    torch.manual_seed(0)
    assert not StagedTarget(AutoModelForCausalLM.from_config(config).eval(), 1).packed_gqa


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_forward_of_several_rows_is_the_repeated_paths_up_to_rounding(family):
    """Chains and trees over a cache past Gemma 3's sliding window: the logits of transformers' SDPA path."""
    packed, plain = StagedTarget(tiny_model(family), 1), StagedTarget(tiny_model(family), 1, plain_attention=True)
    ids = torch.tensor([prompt(3, length=30)])
    outs = []
    for staged in (packed, plain):
        cache = staged.new_cache()
        staged.forward_all(ids[:, :20], cache, 0)
        chain, _ = staged.forward_all(ids[:, 20:26], cache, 20)
        cache.crop(20)
        visible = tree_mask(6, 6)[0, 0]
        tree, _ = staged.forward_all(ids[:, 20:26], cache, 20, offsets=visible.sum(1) - 1, visible=visible)
        outs.append((staged.logits(chain[0]), staged.logits(tree[0])))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, top_k=8)], ids=["greedy", "keyed T=1"])
def test_drafted_decoding_through_it_is_the_targets_own_decoding(family, params):
    """Greedy: AR's tokens; T = 1 with a seed: AR's keyed draws — chains and priced trees, drafts kept and missed."""
    target = tiny_model(family, seed=2, tied=not params.greedy)
    staged = StagedTarget(target, 1)
    assert staged.packed_gqa
    kept, verified = priced_drafts_equal_ar(target, staged, params, 70)
    assert 0 < kept < verified
