"""The tree verification rule keeps the target's distribution at a node whatever its children are (design §8), and
the authors' W > 1 rule — one coin per copy, "any copy accepts" — does not: the same chi-square test passes the
first and rejects the second. Power: 20,000 draws over 6 tokens reject a 3% total-variation shift >= 18 times in 20.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spd.verify.sampling import Proposal, SamplingParams, sample, settle_children

T1 = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
DRAWS = 20000
ALPHA = 1e-3
LOGITS = torch.tensor([1.2, 0.9, 0.1, -0.3, 0.6, -1.0])        # the target's p = softmax
Q = torch.softmax(torch.tensor([0.4, 1.3, 0.8, -0.5, 0.2, 0.0]), -1)   # a drafter's q, far from p
P = torch.softmax(LOGITS, -1)


def pvalue(counts: np.ndarray, p: torch.Tensor) -> float:
    expected = p.double().numpy()
    return float(chisquare(counts, expected / expected.sum() * counts.sum()).pvalue)


def emitted(children_of, rule, seed: int) -> np.ndarray:
    """Counts of the token each of DRAWS verifications emits; children_of(generator) makes a node's children."""
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(len(P))
    for _ in range(DRAWS):
        children = children_of(g)
        index, token = rule(LOGITS, children, T1, g)
        assert index is None or children[index].token == token
        counts[token] += 1
    return counts


def top(k):
    return lambda g: [Proposal(int(t)) for t in torch.topk(Q, k).indices]


def drawn(k):
    return lambda g: [Proposal(sample(Q, g), Q) for _ in range(k)]


def mixed(g):
    return [Proposal(sample(Q, g), Q), Proposal(0), Proposal(sample(Q, g), Q)]


def authors_rule(logits, children, params, g):
    """The SPD authors' W > 1 verification (design §8): each copy's top-k child tested with its own coin
    u * q(x) <= p(x); the first copy that accepts wins; none: a draw from norm(max(p - q, 0))."""
    p = torch.softmax(logits, -1)
    for i, child in enumerate(children):
        if torch.rand((), generator=g) * Q[child.token] <= p[child.token]:
            return i, child.token
    residual = (p - Q).clamp(min=0)
    return None, sample(residual / residual.sum(), g)


def test_the_test_has_power():
    rng = np.random.default_rng(0)
    p = P.double().numpy()
    p /= p.sum()
    rejected = 0
    for _ in range(20):
        direction = p * rng.choice([-1.0, 1.0], size=p.size)
        direction -= p * direction.sum()                     # keep the total at 1
        shifted = p + direction * (0.03 / (0.5 * np.abs(direction).sum()))
        assert shifted.min() >= 0
        shifted /= shifted.sum()
        rejected += pvalue(rng.multinomial(DRAWS, shifted).astype(float), P) < ALPHA
    assert rejected >= 18


@pytest.mark.parametrize("children_of", [top(1), top(3), top(6), drawn(1), drawn(3), mixed],
                         ids=["top1", "top3", "top6", "drawn1", "drawn3", "mixed"])
def test_the_tree_rule_emits_p(children_of):
    counts = emitted(children_of, settle_children, seed=1)
    assert pvalue(counts, P) > ALPHA


def test_deterministic_children_are_kept_with_their_p():
    g = torch.Generator().manual_seed(2)
    children = top(3)(g)
    kept = np.zeros(3)
    for _ in range(DRAWS):
        index, _ = settle_children(LOGITS, children, T1, g)
        if index is not None:
            kept[index] += 1
    want = np.array([float(P[c.token]) for c in children]) * DRAWS
    assert np.all(np.abs(kept - want) < 5 * np.sqrt(want))     # each child's share is its p, within 5 sigma


def test_the_authors_rule_is_not_lossless():
    """The counter-example docs/lossless.md quotes: q's top-2 children, one coin each."""
    counts = emitted(top(2), authors_rule, seed=3)
    assert pvalue(counts, P) < ALPHA
    first = int(torch.argmax(Q))
    assert counts[first] / DRAWS > float(P[first]) + 0.05     # the best-ranked copy's token is over-emitted


def test_greedy_descends_into_the_argmax_child():
    greedy = SamplingParams()
    best = int(torch.argmax(LOGITS))
    children = [Proposal(3), Proposal(best), Proposal(5)]
    assert settle_children(LOGITS, children, greedy, None) == (1, best)
    assert settle_children(LOGITS, [Proposal(3), Proposal(5)], greedy, None) == (None, best)
