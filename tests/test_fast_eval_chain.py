"""EAGLE-3's fast evaluator: its replay settles exactly the cycles the chain runtime does, its drafts are the
runtime's, and traces recorded once serve every layout and EAGLE-3."""

import pytest
import torch

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.models.eagle3 import Eagle3Module
from spd.eval.traces import TraceCache
from spd.eval.fast import record_greedy_trace
from spd.eval.fast_chain import fast_chain_stats, fast_tree_stats, replay_chain
from spd.layout import needed_layers
from spd.runtime.chain import ChainDecoder
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.verify.sampling import Proposal


def chain_summary(stats):
    return stats.N, stats.cycles, stats.accepted, stats.accepted_per_cycle


class TableDrafter(Eagle3Drafter):
    """Drafts from a fixed table: entry (j, i) is the j-th draft after verified position i + 1 (the fast
    evaluator's layout), so the runtime's cycle logic can be held against `replay_chain` on the same drafts."""

    def __init__(self, module, embed, table):
        super().__init__(module, embed)
        self.table = table

    def chain(self, m, choose):
        super().chain(m, choose)
        return [Proposal(int(self.table[j, self.rows - 1])) for j in range(m)]


@pytest.mark.parametrize("m,max_new", [(1, 30), (3, 30), (5, 23)])
def test_replay_settles_the_cycles_the_chain_runtime_does(family_model, m, max_new):
    """Drafts right with probability 0.6 each: runs of every length, misses at every draft index, and cycles cut
    by the end of the output."""
    _, model = family_model
    staged = StagedTarget(model, 1)
    module = Eagle3Module.from_target(staged, seed=m).eval()
    p = prompt(m + 40)
    tokens = ar_run(model, p, max_new).token_ids
    seq = p + tokens
    g = torch.Generator().manual_seed(m)
    table = torch.zeros(m, len(seq), dtype=torch.long)
    for j in range(m):
        for i in range(len(seq) - 2 - j):
            right = float(torch.rand((), generator=g)) < 0.6
            table[j, i] = seq[i + 2 + j] if right else (seq[i + 2 + j] + 1) % model.config.vocab_size
    out = ChainDecoder(staged, TableDrafter(module, staged.embed, table), frozenset(), m).generate(p, Request(max_new, GREEDY))
    assert out.token_ids == tokens
    replayed = replay_chain(m, p, tokens, table)
    assert chain_summary(replayed) == chain_summary(out.stats)
    assert len(set(out.stats.accepted_per_cycle)) >= min(m + 1, 3)   # the case really mixes run lengths


@pytest.mark.parametrize("m", [1, 4])
def test_fast_chain_stats_equal_the_runtime_with_a_real_module(family_model, m):
    _, model = family_model
    staged = StagedTarget(model, 1)
    vocab = torch.arange(0, model.config.vocab_size, 2)
    for seed in range(2):
        module = Eagle3Module.from_target(staged, draft_to_target=vocab if seed else None, seed=seed).eval()
        p = prompt(seed + 60)
        out = ChainDecoder(staged, Eagle3Drafter(module, staged.embed), frozenset(), m).generate(p, Request(40, GREEDY))
        trace = record_greedy_trace(staged, p, 40, frozenset(), module.layers_needed())
        assert trace.tokens == out.token_ids
        fast = fast_chain_stats(module, trace, m)
        assert chain_summary(fast["stats"]) == chain_summary(out.stats)


def test_one_trace_recording_serves_other_layouts_and_eagle3(tiny_target_dir, tmp_path):
    loaded = load_target(tiny_target_dir)
    n2, n3, whole = (StagedTarget(loaded.model, n) for n in (2, 3, 1))
    eagle_layers = Eagle3Module.from_target(whole).layers_needed()
    union = sorted({*needed_layers(n2.bounds), *eagle_layers})
    shared = TraceCache(str(tmp_path), loaded, n3, 12, extra_layers=union)
    first, info = shared.get("gsm8k", 1, [5, 6, 7])
    assert info["recorded_now"] and sorted(first.hidden) == needed_layers(n3.bounds)
    for staged, layers in ((n2, None), (whole, eagle_layers)):
        cache = TraceCache(str(tmp_path), loaded, staged, 12, layers)
        assert cache.directory == shared.directory
        trace, info = cache.get("gsm8k", 1, [5, 6, 7])
        assert not info["recorded_now"] and trace.tokens == first.tokens
        assert sorted(trace.hidden) == (layers or needed_layers(staged.bounds))
        own = record_greedy_trace(staged, [5, 6, 7], 12, cache.eos, sorted(trace.hidden))
        for layer, h in own.hidden.items():       # the shared recording is bitwise what this layout records
            assert torch.equal(trace.hidden[layer], h)
    # a layout whose layers the shared directory lacks gets its own
    lone = TraceCache(str(tmp_path), loaded, StagedTarget(loaded.model, 4), 12)
    assert lone.directory != shared.directory
    # another max_new_tokens never reuses it
    assert TraceCache(str(tmp_path), loaded, n2, 13).directory != shared.directory


def tree_summary(stats):
    return stats.N, stats.cycles, stats.accepted, stats.accepted_per_cycle, stats.drafted


class TreeTableDrafter(Eagle3Drafter):
    """Runs the real dynamic tree (its state and work stay real), then drafts a tree of its own: at each depth W
    children, the target's next token at a random rank among them or absent, and the next depth below it — so
    cycles accept 0..m nodes, first and later children."""

    def __init__(self, module, embed, seq, vocab, seed):
        super().__init__(module, embed)
        self.seq, self.vocab, self.g = seq, vocab, torch.Generator().manual_seed(seed)

    def propose(self, cycle, propose):
        from spd.verify.tree import DraftTree

        super().propose(cycle, propose)
        root, m, width = cycle.root, cycle.m, cycle.width
        tree, parent = DraftTree(root), 0
        for depth in range(1, m + 1):
            true = self.seq[self.rows + depth] if self.rows + depth < len(self.seq) else 0
            rank = int(torch.randint(width + 2, (), generator=self.g))     # >= width: absent
            wrong = iter((true + k) % self.vocab for k in range(1, width + 1))
            nodes = [tree.add(parent, Proposal(true if i == rank else next(wrong))) for i in range(width)]
            if rank >= width:
                break
            parent = nodes[rank]
        return tree


@pytest.mark.parametrize("width", [4])
def test_fast_tree_stats_equal_the_tree_runtime(family_model, width):
    """EAGLE-3's trees: the replay over a greedy trace settles the cycles the chain runtime does — with
    trees that accept at every depth and child (a table drafter), and with the real dynamic tree of a random
    module, whose verified states the replay feeds from the trace."""
    family, model = family_model
    staged = StagedTarget(model, 1)
    m, budget = 4, 4 * width
    module = Eagle3Module.from_target(staged, seed=1).eval()
    p = prompt(70)
    trace = record_greedy_trace(staged, p, 40, frozenset(), module.layers_needed())
    seq = p + trace.tokens
    accepted = []
    for make in (lambda: TreeTableDrafter(module, staged.embed, seq, model.config.vocab_size, seed=width),
                 lambda: Eagle3Drafter(module, staged.embed)):
        out = ChainDecoder(staged, make(), frozenset(), m, width, budget).generate(p, Request(40, GREEDY))
        assert out.token_ids == trace.tokens, family
        fast = fast_tree_stats(make(), trace, m, width, budget)
        assert tree_summary(fast["stats"]) == tree_summary(out.stats), family
        accepted.append(out.stats.accepted_per_cycle)
    assert 0 in accepted[0] and max(accepted[0]) >= 2     # the table's trees: misses and paths of several nodes
