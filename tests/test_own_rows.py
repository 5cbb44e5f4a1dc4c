"""A target at `weights=q4` in its own row arithmetic (spd.targets.own_rows, spd/csrc/llama_layer.cpp, row_ops.h): at
every ISA level this CPU runs, a row's logits have the same bits in a prefill, a chain after a cache and a draft
tree as in the one-row step at its position; the layers in one C++ call are the layers one by one; the result is
transformers' layer over the dequantized weights up to the inputs' 16-bit codes; the attention kernel hides masked keys
exactly (a row with other keys beside it is the row over its own keys alone) and reads boolean, additive and no
masks alike."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from spd.targets import own_rows, panel
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model
from test_blocks import with_blocks

pytestmark = pytest.mark.skipif(panel.extension() is None, reason="the panel kernel cannot be built here")
LEVELS = panel.levels() if panel.extension() is not None else ()
# a draft tree of 5 nodes after a prefix: node i's parent (-1: the prefix's last position)
PARENTS = [-1, 0, 0, 2, 1]


def path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.insert(0, node)
        node = PARENTS[node]
    return out


def step_logits(staged: StagedTarget, prefix: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The logits of `rows` [1, r] decoded one row at a time after `prefix` [1, p] (a one-row AR step each)."""
    cache = staged.new_cache()
    staged.forward_all(prefix, cache)
    out = []
    for i in range(rows.shape[1]):
        hidden, _ = staged.forward_all(rows[:, i: i + 1], cache, start_pos=prefix.shape[1] + i)
        out.append(staged.logits(hidden[0]))
    return torch.cat(out)


def q4_target(level: str, monkeypatch) -> tuple[torch.nn.Module, StagedTarget]:
    monkeypatch.setenv(panel.LEVEL_ENV, level)
    model = with_blocks(tiny_model("llama", seed=5, tied=False))
    staged = StagedTarget(model, 1)
    assert staged.weights == "q4" and model.config._attn_implementation == own_rows.KERNEL
    return model, staged


@pytest.mark.parametrize("level", LEVELS)
def test_a_rows_logits_are_the_one_row_steps_in_a_prefill_a_chain_and_a_tree(level, monkeypatch):
    model, staged = q4_target(level, monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (1, 28), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        alone = step_logits(staged, ids[:, :1], ids[:, 1:])                      # positions 1 .. 27
        prefill = staged.logits(staged.forward_all(ids, None)[0][0])
        assert torch.equal(prefill[1:], alone)
        for rows in (3, 6):
            cache = staged.new_cache()
            staged.forward_all(ids[:, :20], cache)
            chain = staged.logits(staged.forward_all(ids[:, 20:20 + rows], cache, start_pos=20)[0][0])
            assert torch.equal(chain, alone[19:19 + rows]), rows
        visible = torch.tensor([[j in path(i) for j in range(5)] for i in range(5)])
        cache = staged.new_cache()
        staged.forward_all(ids[:, :20], cache)
        tree = staged.logits(staged.forward_all(ids[:, 20:25], cache, 20, visible=visible,
                                                offsets=torch.tensor([len(path(i)) - 1 for i in range(5)]))[0][0])
        for node in range(5):
            replay = step_logits(staged, ids[:, :20], ids[:, [20 + j for j in path(node)]])
            assert torch.equal(tree[node], replay[-1]), node


@pytest.mark.parametrize("level", LEVELS)
def test_the_layers_in_one_call_are_the_layers_one_by_one_and_transformers_up_to_rounding(level, monkeypatch):
    model, staged = q4_target(level, monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(7))

    def chain() -> torch.Tensor:
        cache = staged.new_cache()
        staged.forward_all(ids[:, :18], cache)
        return staged.logits(staged.forward_all(ids[:, 18:], cache, start_pos=18)[0])

    with torch.no_grad():
        together = chain()
        monkeypatch.setattr(StagedTarget, "_own_layers", lambda *args: None)     # each layer its own call
        assert torch.equal(chain(), together)
        # the same weights in float32 (the blocks dequantized): transformers' operators, the inputs not coded
        twin = copy.deepcopy(model)
        for module in twin.modules():
            for held in ("_blocks", "_panels", "_lean", "_row_level"):
                module.__dict__.pop(held, None)
        plain = StagedTarget(twin, 1)
        assert plain.weights == "float32" and twin.config._attn_implementation != own_rows.KERNEL
        assert all(m.__dict__["_panels"][5] == 0 for m in twin.modules() if isinstance(m, panel.PanelLinear))
        cache = plain.new_cache()
        plain.forward_all(ids[:, :18], cache)
        reference = plain.logits(plain.forward_all(ids[:, 18:], cache, start_pos=18)[0])
    assert (together - reference).abs().max() < 1e-4 * reference.abs().max()


def sdpa(q, k, v, visible):
    # float64 reference: q [B, H, T, D], k/v [B, Hkv, S, D], visible [B, 1, T, S]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=visible).transpose(1, 2)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("head_dim", [64, 24, 5])
def test_the_attention_hides_masked_keys_exactly_and_reads_every_mask_form(level, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    b, h, kv, t, s = 2, 6, 2, 5, 40
    q, k, v = (torch.randn(b, n, r, head_dim, generator=g) * 3 for n, r in ((h, t), (kv, s), (kv, s)))
    visible = torch.rand(b, 1, t, s, generator=g) < 0.6
    visible[..., 0] = True
    scale = head_dim ** -0.5
    ext = panel.extension()
    attend = lambda mask, q=q, k=k, v=v: ext.own_attention(q, k, v, mask, scale, panel.LEVELS.index(level))
    got = attend(visible)                                                       # [B, T, H, D]
    assert (got.double() - sdpa(q * scale / head_dim ** -0.5, k, v, visible)).abs().max() < 1e-5
    additive = torch.zeros(visible.shape).masked_fill_(~visible, -math.inf)
    assert torch.equal(attend(additive), got)
    for bi in range(b):           # a row over its visible keys alone, one row a call: the same bits
        for ti in range(t):
            keys = visible[bi, 0, ti].nonzero().view(-1)
            alone = ext.own_attention(q[bi:bi + 1, :, ti:ti + 1], k[bi:bi + 1, :, keys], v[bi:bi + 1, :, keys],
                                             None, scale, panel.LEVELS.index(level))
            assert torch.equal(alone[0, 0], got[bi, ti]), (bi, ti)
    causal = torch.ones(t, s, dtype=torch.bool).tril(s - t).expand(b, 1, t, s)
    assert torch.equal(attend(None), attend(causal))                              # no mask: row t sees 0 .. S - T + t
