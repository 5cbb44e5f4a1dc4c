"""The context-lookup drafter: its incremental n-gram pool finds what a rescan finds, its drafts copy (and loop)
the context, and the chain decodes with it exactly like AR, greedy, on every tiny target family."""

import random

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.drafters.base import Cycle
from spd.decoding import Request
from spd.drafters.lookup import LookupDrafter, NgramIndex
from spd.eval.fast import record_greedy_trace
from spd.eval.fast_chain import fast_lookup_stats
from spd.runtime.chain import ChainDecoder
from spd.verify.sampling import verify_point_mass, warp, SamplingParams
from spd.targets.stages import StagedTarget


def rescan(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """The longest suffix (min_n..max_n tokens) that occurred earlier, and where its newest such occurrence ended."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):      # occurrences ending before the last token, newest first
            if tokens[end - n: end] == suffix:
                return n, end
    return 0, -1


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 8), (3, 3)])
def test_the_incremental_pool_finds_what_a_rescan_finds(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(30):
        index, tokens = NgramIndex(min_n, max_n), []
        while len(tokens) < 60:
            chunk = [rng.randrange(4) for _ in range(rng.randint(1, 5))]   # 4 symbols: many repeats
            index.extend(chunk)
            tokens += chunk
            assert index.match() == rescan(tokens, min_n, max_n), tokens


def test_the_continuation_copies_and_loops():
    index = NgramIndex(1, 4)
    index.extend([7, 1, 2, 3, 1, 2])
    n, start = index.match()
    assert (n, start) == (2, 3)                                   # "1 2" occurred at 1..2, followed by 3
    assert index.continuation(start, 6) == [3, 1, 2, 3, 1, 2]     # reads its own output past the end
    assert NgramIndex(2, 4).match() == (0, -1)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_no_match_no_drafts():
    drafter = LookupDrafter(min_n=2, max_n=4)
    drafter.start({}, [1, 2, 3, 4])
    assert drafter.chain(5) == [] and drafter.last_match == 0
    drafter.observe({}, [1, 2, 3, 4, 1, 2])
    assert [p.token for p in drafter.chain(3)] == [3, 4, 1] and drafter.last_match == 2
    assert all(p.q is None for p in drafter.chain(3))             # deterministic: a point mass when sampling


@pytest.mark.parametrize("m", [1, 4, 8])
def test_lookup_chain_greedy_equals_ar(family_model, untied_target_dir, m):
    """Tied tiny targets loop (the lookup is right most of the time), the untied one does not (mostly wrong): both
    paths, on every family."""
    from spd.targets.loading import load_target

    family, model = family_model
    for target in (model, load_target(untied_target_dir).model):
        staged = StagedTarget(target, 1)
        for seed in range(2):
            p = prompt(seed + 50, vocab=target.config.vocab_size)
            ar = ar_run(target, p, 40).token_ids
            out = ChainDecoder(staged, LookupDrafter(min_n=1, max_n=4), frozenset(), m).generate(p, Request(40, GREEDY))
            assert out.token_ids == ar, (family, m, seed)
    assert out.stats.N == 40


@pytest.mark.parametrize("m", [1, 4])
def test_the_fast_lookup_replay_equals_the_chain(family_model, untied_target_dir, m):
    """The eval's fast evaluator for method=lookup: the same cycles, acceptances and rows as the runtime."""
    from spd.targets.loading import load_target

    family, model = family_model
    histories = set()
    for target in (model, load_target(untied_target_dir).model):
        staged = StagedTarget(target, 1)
        for seed in range(2):
            p = prompt(seed + 70, vocab=target.config.vocab_size)
            out = ChainDecoder(staged, LookupDrafter(1, 4), frozenset(), m).generate(p, Request(40, GREEDY))
            trace = record_greedy_trace(staged, p, 40, frozenset())
            fast = fast_lookup_stats(trace, 1, 4, m)
            got, want = fast["stats"], out.stats
            assert (got.N, got.cycles, got.accepted, got.accepted_per_cycle, got.sources, got.verdicts) == \
                (want.N, want.cycles, want.accepted, want.accepted_per_cycle, want.sources, want.verdicts), (family, seed)
            assert len(fast["rows_per_cycle"]) == got.cycles and all(1 <= r <= m + 1 for r in fast["rows_per_cycle"])
            histories.add(tuple(sorted(set(want.accepted_per_cycle))))
    assert len(histories) > 1 or len(histories.pop()) > 1     # hits and misses both occur


def test_lookup_on_a_loop_settles_m_plus_one_per_cycle(family_model):
    _, model = family_model
    p = [5, 6, 7] * 4
    ar = ar_run(model, p, 40).token_ids
    out = ChainDecoder(StagedTarget(model, 1), LookupDrafter(1, 4), frozenset(), 4).generate(p, Request(40, GREEDY))
    assert out.token_ids == ar
    if len(set(ar[1:])) == 1:                  # the tied targets repeat one token: every lookup draft holds
        assert out.stats.tau == pytest.approx(39 / out.stats.cycles) and out.stats.cycles <= 8


def test_point_mass_rule_output_is_exactly_p():
    """P(out = y) = [y = x] p(x) + (1 - p(x)) p(y) [y != x] / (1 - p(x)) = p(y): verified by counting draws."""
    g = torch.Generator().manual_seed(0)
    p = warp(torch.tensor([2.0, 1.0, 0.5, -1.0]), SamplingParams(temperature=1.0))
    counts = torch.zeros(4)
    draws = 40000
    for _ in range(draws):
        counts[verify_point_mass(0, p, g)[1]] += 1
    torch.testing.assert_close(counts / draws, p, atol=0.01, rtol=0)
    assert verify_point_mass(1, torch.tensor([0.0, 1.0]), g) == (True, 1)    # p(x) = 1: always accepted
    assert verify_point_mass(0, torch.tensor([0.0, 1.0]), g) == (False, 1)   # p(x) = 0: never


def rescan_matches(tokens, min_n, max_n, limit):
    """Every earlier occurrence's continuation start, longest suffix first, newest first within a length."""
    out = []
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n: end] == suffix and end not in out and len(out) < limit:
                out.append(end)
    return out


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 8)])
def test_every_earlier_match_is_found_and_truncation_forgets_them(min_n, max_n):
    rng = random.Random(min_n * 7 + max_n)
    for _ in range(20):
        index, tokens = NgramIndex(min_n, max_n), []
        while len(tokens) < 50:
            chunk = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            index.extend(chunk)
            tokens += chunk
            if rng.random() < 0.3:                 # drafts flushed: the pool must be as a shorter context makes it
                keep = rng.randint(0, len(tokens))
                index.truncate(keep)
                tokens = tokens[:keep]
            assert index.matches(6) == rescan_matches(tokens, min_n, max_n, 6), tokens


def test_the_lookup_tree_branches_where_continuations_differ():
    drafter = LookupDrafter(min_n=1, max_n=4)
    drafter.start({}, [5, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    tree = drafter.propose(Cycle(2, 3, 2, 16))
    # "1 2" was followed by "4 9 1" (newest) and by "3 9 1": two branches under the root
    assert [tree.token(c) for c in tree.children(0)] == [4, 3]
    assert [tree.token(i) for i in tree.path(3)] == [2, 4, 9, 1]
    assert all(len(tree.children(i)) <= 2 for i in range(len(tree))) and len(tree) - 1 <= 16
    assert len(drafter.propose(Cycle(2, 3, 2, 4))) == 5                # the budget caps the nodes
    chain = drafter.propose(Cycle(2, 3, 1, 16))
    assert chain.is_chain() and [p.token for p in chain.proposals] == [4, 9, 1]


@pytest.mark.parametrize("width,budget", [(2, 8), (4, 16)])
def test_lookup_trees_greedy_equal_ar_and_the_replay(family_model, untied_target_dir, width, budget):
    from spd.targets.loading import load_target

    _, model = family_model
    branched = 0
    for target in (model, load_target(untied_target_dir).model):
        staged = StagedTarget(target, 1)
        for seed in range(2):
            p = prompt(seed + 150, vocab=target.config.vocab_size)
            out = ChainDecoder(staged, LookupDrafter(1, 4), frozenset(), 4, width, budget).generate(p, Request(40, GREEDY))
            trace = record_greedy_trace(staged, p, 40, frozenset())
            assert out.token_ids == trace.tokens
            fast = fast_lookup_stats(trace, 1, 4, 4, width=width, budget=budget)
            got, want = fast["stats"], out.stats
            assert (got.N, got.cycles, got.accepted_per_cycle, got.sources, got.verdicts) == \
                (want.N, want.cycles, want.accepted_per_cycle, want.sources, want.verdicts)
            assert sum(fast["rows_per_cycle"]) == want.drafted + want.cycles
            branched += sum(r > 5 for r in fast["rows_per_cycle"])     # wider than a chain of 4 could be
    assert branched > 0
