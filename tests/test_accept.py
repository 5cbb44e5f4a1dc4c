"""The verdict on deterministic drafts (spd.verify.accept): the tensor functions the device steps and the host loop
share keep exactly the path a walk from the root keeps, node by node, with the target's own choices."""

import random

import pytest
import torch

from spd.verify.accept import greedy_choices, kept_drafts, kept_path, keyed_choices
from spd.verify.sampling import BLOCK, KeyedDraws, Proposal, SamplingParams, greedy_token, next_token
from spd.verify.tree import DraftTree


def random_tree(rng: random.Random, nodes: int, vocab: int) -> DraftTree:
    """A tree of `nodes` drafts, parents first, siblings with different tokens (as every drafter's are)."""
    tree = DraftTree(rng.randrange(vocab))
    for _ in range(nodes):
        parent = rng.randrange(len(tree))
        taken = {tree.token(c) for c in tree.children(parent)}
        free = [t for t in range(vocab) if t not in taken]
        if free:
            tree.add(parent, Proposal(rng.choice(free)))
    return tree


def walk(tree: DraftTree, chosen: list[int]) -> list[int]:
    """The kept path by hand: from the root, into the child that is the choice after its parent."""
    path = [0]
    while True:
        child = next((c for c in tree.children(path[-1]) if tree.token(c) == chosen[path[-1]]), None)
        if child is None:
            return path
        path.append(child)


def tree_verdict(tree: DraftTree, chosen: torch.Tensor) -> list[int]:
    kept, best, path = kept_path(torch.tensor(tree.tokens()), chosen, torch.ones(len(tree), dtype=torch.bool),
                                 torch.tensor(tree.depths()), torch.tensor([0, *tree.parents]), tree.visibility())
    assert int(best) == path[int(kept)]
    return path[: int(kept) + 1].tolist()


@pytest.mark.parametrize("seed", range(40))
def test_the_tree_verdict_keeps_the_walks_path(seed):
    rng = random.Random(seed)
    vocab = 3                                 # few tokens: choices often hit, and deep paths are kept
    tree = random_tree(rng, rng.randrange(0, 12), vocab)
    for _ in range(20):
        chosen = [rng.randrange(vocab) for _ in range(len(tree))]
        assert tree_verdict(tree, torch.tensor(chosen)) == walk(tree, chosen)


@pytest.mark.parametrize("seed", range(20))
def test_the_chain_verdict_is_the_longest_prefix_of_choices(seed):
    rng = random.Random(seed)
    k = rng.randrange(0, 8)
    drafts = [rng.randrange(2) for _ in range(k)]
    choices = [rng.randrange(2) for _ in range(k)]
    real = [rng.random() < 0.9 for _ in range(k)]
    want = next((i for i in range(k) if drafts[i] != choices[i] or not real[i]), k)
    assert int(kept_drafts(torch.tensor(drafts, dtype=torch.long), torch.tensor(choices, dtype=torch.long),
                           torch.tensor(real, dtype=torch.bool))) == want
    # a chain is the tree whose every parent is the row before: both verdicts agree
    tree = DraftTree.chain(0, [Proposal(t) for t in drafts])
    chosen = torch.tensor(choices + [0], dtype=torch.long)
    assert len(tree_verdict(tree, chosen)) - 1 == int(kept_drafts(torch.tensor(drafts, dtype=torch.long),
                                                                  chosen[:-1]))


def test_greedy_choices_are_greedy_token_row_by_row_ties_included():
    torch.manual_seed(0)
    for vocab in (16, 64 * BLOCK, 64 * BLOCK + 3):
        logits = torch.randn(6, vocab).round(decimals=1)          # rounded: ties between blocks and inside them
        logits[2] = 0.0                                            # a row of ties: the lowest id
        logits[3, 5] = logits[3, vocab - 1] = logits[3].max() + 1
        got = greedy_choices(logits)
        assert got.tolist() == [greedy_token(row) for row in logits]
        assert int(got[2]) == 0 and int(got[3]) == 5


def test_keyed_choices_are_ars_draws_and_record_nothing():
    params = SamplingParams(1.0, 20, 0.9)
    draws, twin = KeyedDraws(1234, 300), KeyedDraws(1234, 300)
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    positions = [40, 41, 41, 42, 43]
    chosen, chances = keyed_choices(logits, params, draws, positions)
    assert chosen.tolist() == [next_token(row, params, None, twin, pos) for row, pos in zip(logits, positions)]
    assert not draws.drawn                          # rows off the kept path must not record a chance
    assert chances[0] == twin.chance(40) and chances[4] == twin.chance(43)


def test_keyed_choices_draw_only_the_rows_the_verdict_reads():
    params = SamplingParams(1.0, 0, 1.0)
    vocab = 4
    logits = torch.zeros(4, vocab)
    logits[0, 2] = 50.0                              # the root's draw is 2, all but surely
    tree = DraftTree(0)
    tree.add(0, Proposal(2))                          # row 1: held
    tree.add(0, Proposal(3))                          # row 2: missed, never drawn
    tree.add(2, Proposal(1))                          # row 3: below a miss, never drawn
    draws, twin = KeyedDraws(7, vocab), KeyedDraws(7, vocab)
    positions = [10 + d for d in tree.depths()]
    chosen, chances = keyed_choices(logits, params, draws, positions, tree.tokens(), [0, *tree.parents])
    full, _ = keyed_choices(logits, params, twin, positions)
    assert chosen[:2].tolist() == full[:2].tolist() and chosen[2:].tolist() == [-1, -1]
    assert tree_verdict(tree, chosen) == tree_verdict(tree, full) == [0, 1]
