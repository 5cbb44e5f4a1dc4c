"""A draft tree through the target: each node's output is its own root path's, a chain through the tree path is the
chain bit for bit, and the cache kept for an accepted path equals a fresh prefill of that path (design §8)."""

import random

import pytest
import torch

from helpers import prompt
from spd.verify.sampling import Proposal
from spd.targets.stages import StagedTarget
from spd.verify.tree import DraftTree


def random_tree(seed: int, nodes: int, vocab: int) -> DraftTree:
    rng = random.Random(seed)
    tree = DraftTree(rng.randrange(vocab))
    for _ in range(nodes):
        tree.add(rng.randrange(len(tree)), Proposal(rng.randrange(vocab)))
    return tree


def run_tree(staged: StagedTarget, prompt_ids: list[int], tree: DraftTree):
    """Prefill the prompt, then the tree's rows; returns (logits [T, V], cache)."""
    cache = staged.new_cache()
    staged.forward_all(torch.tensor([prompt_ids]), cache)
    ids = torch.tensor([tree.tokens()])
    hidden, _ = staged.forward_all(ids, cache, len(prompt_ids), offsets=torch.tensor(tree.depths()),
                                   visible=tree.visibility())
    return staged.logits(hidden[0]), cache


def test_visibility_is_the_ancestor_closure():
    tree = DraftTree(5)
    for parent in (0, 0, 1, 3, 2, 0):
        tree.add(parent, Proposal(1))
    visible = tree.visibility()
    for i in range(len(tree)):
        assert set(visible[i].nonzero().flatten().tolist()) == set(tree.path(i))
    assert tree.depths() == [0, 1, 1, 2, 3, 2, 1]
    assert DraftTree.chain(5, [Proposal(1)] * 3).visibility().equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))


@pytest.mark.parametrize("seed", [0, 1])
def test_every_node_sees_only_its_root_path(family_model, seed):
    """Gemma3's tiny target has an 8-token sliding window: the paths cross it."""
    _, model = family_model
    staged = StagedTarget(model, 1)
    p = prompt(seed + 80, length=10)
    tree = random_tree(seed, 12, model.config.vocab_size)
    logits, _ = run_tree(staged, p, tree)
    for node in range(len(tree)):
        path = [tree.token(i) for i in tree.path(node)]
        hidden, _ = staged.forward_all(torch.tensor([p + path]), None)
        torch.testing.assert_close(logits[node], staged.logits(hidden[0, -1]), atol=1e-4, rtol=1e-4)


def test_a_chain_through_the_tree_path_is_the_chain_bit_for_bit(family_model):
    _, model = family_model
    staged = StagedTarget(model, 1)
    p = prompt(90, length=10)
    chain = DraftTree.chain(3, [Proposal(t) for t in (7, 9, 2, 2, 11)])
    tree_logits, tree_cache = run_tree(staged, p, chain)
    cache = staged.new_cache()
    staged.forward_all(torch.tensor([p]), cache)
    hidden, _ = staged.forward_all(torch.tensor([chain.tokens()]), cache, len(p))
    assert torch.equal(tree_logits, staged.logits(hidden[0]))
    for layer in range(staged.num_layers):
        for slot in range(cache.lengths[layer]):    # K/V rows, or a linear layer's states (bitwise the chain's)
            if slot >= len(p) - 1:
                assert all(torch.equal(a, b) for a, b in zip(tree_cache.memory(layer, slot), cache.memory(layer, slot)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kept_path_equals_a_fresh_prefill(family_model, seed):
    """After a tree pass, keeping one node's root path leaves the cache a prefill of prompt + path would make, in
    every layer (keys not re-rotated: they were rotated at the positions they keep), and decoding goes on from it."""
    _, model = family_model
    staged = StagedTarget(model, 1)
    p = prompt(seed + 100, length=9)
    tree = random_tree(seed + 10, 10, model.config.vocab_size)
    node = max(range(len(tree)), key=lambda i: (len(tree.path(i)), i))   # a deepest node: its path moves rows
    _, cache = run_tree(staged, p, tree)
    path = tree.path(node)
    cache.keep(len(p), [len(p) + i for i in path])
    fresh = staged.new_cache()
    staged.forward_all(torch.tensor([p + [tree.token(i) for i in path]]), fresh)
    for layer in range(staged.num_layers):
        for slot in range(len(p) - 1, fresh.lengths[layer]):   # K/V rows, or a linear layer's states after each
            for kept, want in zip(cache.memory(layer, slot), fresh.memory(layer, slot)):
                torch.testing.assert_close(kept, want, atol=1e-5, rtol=1e-5)
    after, _ = staged.forward_all(torch.tensor([[4]]), cache, len(p) + len(path))
    want, _ = staged.forward_all(torch.tensor([[4]]), fresh, len(p) + len(path))
    torch.testing.assert_close(after, want, atol=1e-5, rtol=1e-5)
