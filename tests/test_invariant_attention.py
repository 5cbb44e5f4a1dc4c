"""Row-invariant attention (spd.targets.invariant_attention): a CPU target in bfloat16 gives each row the same bits
however many rows share its forward, so greedy draft-then-verify equals AR token for token and keyed sampling draws
AR's tokens — exactly, on every family — and the kernel computes attention (it agrees with SDPA to bfloat16's
precision, and to float32's in float32, under every mask the suite makes)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from helpers import ar_run, prompt
from spd.decoding import Request, prefill
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.runtime.batch import BatchDecoder
from spd.runtime.chain import ChainDecoder
from spd.verify.sampling import Proposal, SamplingParams
from spd.targets import invariant_attention
from spd.targets.invariant_attention import row_invariant_attention
from spd.targets.stages import StagedTarget
from spd.targets.tiny import FAMILIES, HYBRIDS, tiny_model
from spd.verify.tree import DraftTree
from test_suffix import CPU_LIKE

BF16 = torch.bfloat16


def bf16_model(family: str, seed: int = 0, tied: bool = False):
    """Wide enough that this CPU's bfloat16 products are one kernel at every row count (a 32-wide one is not:
    `test_a_target_whose_products_are_not_invariant_keeps_sdpa`). Untied, its answers depend on the whole context."""
    # the hybrid's linear layers: projections of the widths the other families' layers have (256 -> 128, 256, 512)
    linear = {"linear": (32, 4, 128, 2)} if family in HYBRIDS else {}
    return tiny_model(family, seed=seed, tied=tied, hidden_size=256, head_dim=64, **linear).to(BF16)


@pytest.mark.parametrize("d_in,d_out", [(32, 64), (576, 1536), (1536, 576), (576, 49152 // 8)])
def test_the_load_check_never_passes_products_that_change_with_the_row_count(d_in, d_out, record_property):
    """What the kernel builds on is the CPU's own: oneDNN picks a bfloat16 kernel by shape, so whether a product's row
    has the same bits in a call of 1 row as of 17 differs between machines (AMX CPUs keep SmolLM2's shapes in one
    kernel; an AVX-512 AMD EPYC changes kernel for 1536 -> 576 at 4 rows). The check at load must never pass a shape
    whose rows change here. Random products are a weaker probe than the check's cancelling sums, so a shape the
    check refuses may still look invariant on them."""
    g = torch.Generator().manual_seed(d_in * d_out)
    w = (torch.randn(d_out, d_in, generator=g) * 0.05).to(BF16)
    x = torch.randn(17, d_in, generator=g).to(BF16)
    alone = torch.cat([F.linear(x[i: i + 1], w) for i in range(17)])
    observed = all(torch.equal(F.linear(x[:rows], w), alone[:rows]) for rows in (2, 3, 4, 8, 17))
    claimed = invariant_attention.same_bits_at_every_row_count(d_in, d_out)
    record_property("row_invariant_here", {"observed": observed, "check": claimed})
    assert observed or not claimed, f"the check passes {d_in} -> {d_out}, whose rows change with the row count here"


def test_the_load_check_never_passes_scores_that_change_with_their_call():
    """The kernel's own products (scores over head_dim 64, values over BLOCK): where the check passes them, a score
    has the same bits whatever rows and columns its call has."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 48, 64, generator=g).to(BF16), torch.randn(3, 500, 64, generator=g).to(BF16)
    full = q @ k.transpose(1, 2)
    observed = all(torch.equal(q[:, :rows] @ k[:, :cols].transpose(1, 2), full[:, :rows, :cols])
                   for rows, cols in [(3, 500), (3, 17), (48, 64), (9, 333)])
    assert observed or not invariant_attention.products_invariant((), 64)


class _Module:
    is_causal = True
    num_key_value_groups = 3
    training = False


def masks(t: int, s: int):
    """Every kind of mask a layer meets: (name, mask [1, 1, T, S] or None)."""
    start = s - t
    keys, rows = torch.arange(s).view(1, -1), torch.arange(start, s).view(-1, 1)
    causal = keys <= rows
    tree = torch.zeros(t, t, dtype=torch.bool)
    parents = [-1] + [int(torch.randint(0, i, (), generator=torch.Generator().manual_seed(i))) for i in range(1, t)]
    for i in range(t):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parents[j]
    tree_mask = torch.cat([torch.ones(t, start, dtype=torch.bool), tree], 1)
    window = causal & (keys > rows - 40)
    padded = causal.clone()
    padded[0] = False
    return [("chain", causal), ("tree", tree_mask), ("sliding", window), ("padding row", padded)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (BF16, 2e-2)])
def test_the_kernel_is_attention(dtype, tol):
    g = torch.Generator().manual_seed(1)
    module = _Module()
    for t, s in [(1, 70), (6, 6), (9, 150), (17, 300)]:
        q = torch.randn(1, 6, t, 16, generator=g).to(dtype)
        k, v = (torch.randn(1, 2, s, 16, generator=g).to(dtype) for _ in range(2))
        cases = ([("none", None)] if t in (1, s) else []) + (masks(t, s) if t < s else [])
        for name, mask in cases:
            m = None if mask is None else mask.view(1, 1, t, s)
            ours, _ = row_invariant_attention(module, q, k, v, m, scaling=0.25)
            ref, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.25)
            rows = slice(1, None) if name == "padding row" else slice(None)
            assert torch.allclose(ours[:, rows].float(), ref[:, rows].float(), atol=tol, rtol=tol), (t, s, name)
            if name == "padding row":
                assert torch.equal(ours[:, 0], torch.zeros_like(ours[:, 0]))      # attends to nothing


def random_tree(root: int, vocab: int, nodes: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree(root)
    for i in range(1, nodes):
        tree.add(int(torch.randint(0, i, (), generator=g)), Proposal(int(torch.randint(1, vocab, (), generator=g))))
    return tree


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_of_a_tree_is_the_one_row_step_bit_for_bit(family):
    """A tree's (and a chain's) logits, row by row, against the target fed each row's path one token a forward."""
    model = bf16_model(family)
    staged = StagedTarget(model, 1)
    assert model.config._attn_implementation == invariant_attention.KERNEL
    ids = prompt(3, 20, model.config.vocab_size)
    for seed, nodes in [(0, 12), (1, 17), (2, 5)]:
        tree = random_tree(ids[-1], model.config.vocab_size, nodes, seed)
        if seed == 2:
            tree = DraftTree.chain(ids[-1], [Proposal(t) for t in prompt(9, nodes - 1, model.config.vocab_size)])
        with torch.no_grad():
            cache, _, _ = prefill(staged, ids[:-1], frozenset(), 64)
            fed = len(ids) - 1
            out, _ = staged.forward_all(torch.tensor([tree.tokens()]), cache, fed, offsets=torch.tensor(tree.depths()),
                                        visible=tree.visibility())
            together = staged.logits(out[0])
            for node in range(len(tree)):
                path = [node]
                while path[-1]:
                    path.append(tree.parent(path[-1]))
                alone, _, _ = prefill(staged, ids[:-1], frozenset(), 64)
                for depth, n in enumerate(reversed(path)):
                    out, _ = staged.forward_all(torch.tensor([[tree.token(n)]]), alone, fed + depth)
                assert torch.equal(staged.logits(out[0, -1]), together[node]), (family, seed, node)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0, top_k=8)], ids=["greedy", "keyed T=1"])
def test_drafted_decoding_is_ar_in_bfloat16(family, params):
    """Greedy: AR's tokens; T = 1 with a seed: AR's keyed draws — chains and priced trees, drafts kept and missed."""
    model = bf16_model(family, seed=1, tied=not params.greedy)    # tied at T = 1: runs the drafts keep
    staged = StagedTarget(model, 1)
    decoders = {"lookup chain": ChainDecoder(staged, LookupDrafter(1, 3), frozenset(), 4),
                "suffix W=4": ChainDecoder(staged, SuffixDrafter(1, 4, CPU_LIKE), frozenset(), 8, 4, 12)}
    kept = missed = 0
    for name, decoder in decoders.items():
        for seed in range(3):
            p = prompt(seed + 40, 10 + 7 * seed, model.config.vocab_size)
            out = decoder.generate(p, Request(48, params, seed))
            assert out.token_ids == ar_run(model, p, 48, params, seed=seed).token_ids, (family, name, seed)
            kept += out.stats.accepted
            missed += out.stats.drafted - out.stats.accepted
    # both verdicts, many times each; how many drafts hold follows the text the target writes, which follows the
    # CPU's bfloat16 products (the tiny Qwen3.5 keeps 13 on an AMD EPYC, more on an Intel Xeon)
    assert kept > 10 and missed > 5, (kept, missed)


def test_a_bfloat16_batch_decodes_what_each_request_decodes_alone():
    model = bf16_model("llama", seed=2)
    staged = StagedTarget(model, 1)
    prompts = [prompt(70 + i, 4 + 5 * i, model.config.vocab_size) for i in range(4)]
    for params in (SamplingParams(), SamplingParams(1.0, top_k=8)):
        batch = BatchDecoder(staged, frozenset(), lambda: SuffixDrafter(1, 4, CPU_LIKE), 8, 4, 12, max_batch=3)
        tickets = [batch.submit(p, Request(30, params, 200 + i)) for i, p in enumerate(prompts)]
        while batch.busy:
            batch.step()
        for i, (ticket, p) in enumerate(zip(tickets, prompts)):
            assert ticket.tokens == ar_run(model, p, 30, params, seed=200 + i).token_ids, (params, i)


def test_float32_keeps_sdpa():
    model = tiny_model("llama")
    assert not StagedTarget(model, 1).row_invariant
    assert model.config._attn_implementation != invariant_attention.KERNEL


def test_a_target_whose_products_are_not_invariant_keeps_sdpa():
    """The check can fail: a 32-wide target's bfloat16 products change kernel with the row count here, so it keeps
    SDPA and says why (where the CPU's products are one kernel at every shape, nothing is flagged and the check
    passes — then this test has nothing to show)."""
    shapes = ((32, 64), (64, 32), (32, 32))
    if invariant_attention.products_invariant(shapes, 8):
        pytest.skip("this CPU's bfloat16 products are row-invariant even 32 wide")
    model = tiny_model("llama").to(BF16)
    with pytest.warns(UserWarning, match="dtype=float32"):
        assert not StagedTarget(model, 1).row_invariant
    assert model.config._attn_implementation != invariant_attention.KERNEL


@pytest.mark.skipif("amx_bf16" not in open("/proc/cpuinfo").read(), reason="measured on CPUs with AMX only")
def test_smollm2_shapes_are_checked_invariant_here():
    """The default target's products (q/o 576, k/v 192, MLP 1536, head 49,152) and head size 64, on a CPU with
    AMX (the Intel Xeon machines of docs/speed-cpu.md)."""
    shapes = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
    assert invariant_attention.products_invariant(shapes, 64)
