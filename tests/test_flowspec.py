"""FlowSpec (`method=flowspec`): the draft tree on the controller, cut into segments of S nodes that flow through the
stages one per step; an exiting segment's logits continue the walk from the frontier, a kept child prunes every
stage, the segments in flight and those waiting, a miss flushes and starts a new round, and the tree grows again
from every new context. Greedy output equals plain decoding on every tiny family; the stages' caches after every
prune equal fresh prefills of what they hold."""

import json

import pytest
import torch

import spd.runtime.segments as segments
from helpers import count_kept_children, eval_replay_equals_runtime, ar_run, prompt
from spd.decoding import Request
from spd.drafters.base import CHAIN, TREES, Drafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.runtime.schedule import IDLE, segment_step
from spd.runtime.segments import SegmentFlight, SegmentPipelineDecoder
from spd.verify.sampling import Proposal
from spd.targets.stages import StagedTarget
from spd.verify.tree import DraftTree


class NoisyTargetTrees(Drafter):
    """Trees grown best-first from the target's own logits plus noise fixed by position: their first, later or no
    child is the target's token in turn (the tiny targets repeat themselves, which the context's drafters always
    get right)."""

    capabilities = frozenset({CHAIN, TREES})

    def __init__(self, model, scale: float = 1.5):
        self.model, self.scale = model, scale

    def start(self, prompt_hidden, tokens):
        self.tokens = list(tokens)

    def observe(self, hidden, tokens):
        self.tokens = list(tokens)

    def _children(self, path: list[int], width: int) -> list[int]:
        with torch.no_grad():
            logits = self.model(torch.tensor([self.tokens + path])).logits[0, -1]
        g = torch.Generator().manual_seed(len(self.tokens) + len(path))
        logits = logits + self.scale * logits.std() * torch.randn(logits.shape, generator=g)
        return logits.topk(width).indices.tolist()

    def propose(self, cycle, propose=None):
        root, m, width, budget = cycle.root, cycle.m, cycle.width, cycle.budget
        tree, frontier = DraftTree(root), [(0, [])]
        for _ in range(m):
            grown = []
            for node, path in frontier:
                for token in self._children(path, width):
                    if len(tree) > budget:
                        return tree
                    grown.append((tree.add(node, Proposal(token, source="noisy")), path + [token]))
            frontier = grown[:width]
        return tree


@pytest.fixture
def kept_children(monkeypatch):
    """The index of the child each verification kept (None: a correction)."""
    return count_kept_children(monkeypatch, segments)


def flowspec(model, n, segment, depth, width, budget, drafter=None, executor=None):
    return SegmentPipelineDecoder(executor or StagedTarget(model, n), drafter or NoisyTargetTrees(model), frozenset(),
                                  segment, depth, width, budget)


def test_the_segment_schedule():
    """One segment enters a step, each moves a stage a step, the last stage's leaves; a flush empties it."""
    step = segment_step(None, 0, 3)
    assert step.work == (0, IDLE, IDLE) and step.exiting is None
    step = segment_step(segment_step(step, 1, 3), IDLE, 3)
    assert step.work == (IDLE, 1, 0) and step.exiting == 0 and step.occupancy == 2
    assert segment_step(None, 5, 3).work == (5, IDLE, IDLE)


def test_segment_flight_grows_cuts_and_prunes():
    flight = SegmentFlight()
    root = flight.seed(10, 7)
    tree = DraftTree(7)
    a = tree.add(0, Proposal(1))
    tree.add(0, Proposal(2))
    tree.add(a, Proposal(3))
    new = flight.grow(root, tree)
    assert [flight.nodes[n].pos for n in new] == [11, 11, 12] and flight.branch(new[2]) == [root, new[0], new[2]]
    keys = flight.cut([root, *new], 3)
    assert [flight.level(k) for k in keys] == [[root, new[0], new[1]], [new[2]]]
    assert flight.grow(root, tree) == []                        # paths it holds are not added twice
    flight.leave(root)
    assert sorted(flight.keep(new[0])) == [new[1]] and flight.oldest == 11
    assert flight.level(keys[0]) == [new[0]]


@pytest.mark.parametrize("n, segment, depth, width, budget", [(2, 1, 4, 1, 4), (3, 3, 4, 2, 10), (2, 4, 5, 3, 16)])
def test_greedy_flowspec_equals_plain_decoding(family_model, n, segment, depth, width, budget, kept_children):
    family, model = family_model
    for seed in range(2):
        ids = prompt(seed, 10)
        out = flowspec(model, n, segment, depth, width, budget).generate(ids, Request(40))
        assert out.token_ids == ar_run(model, ids, 40).token_ids, (family, seed)
        assert out.stats.N == 40 and out.stats.K < 40 * n     # fewer steps than the pipeline relaying each token
    kept = [k for k in kept_children if k is not None]
    assert None in kept_children and 0 in kept                # corrections and kept drafts
    if width > 1:
        assert max(kept) >= 1                                 # later children kept


@pytest.mark.parametrize("drafter", [LookupDrafter, SuffixDrafter])
def test_context_drafters_grow_flowspec_trees(family_model, drafter):
    """The context's lookup and statistics as FlowSpec's draft side: lossless, and on these repeating targets most
    tokens arrive several a step."""
    _, model = family_model
    ids = prompt(2, 10)
    ids += ids[:6]
    out = flowspec(model, 2, 4, 5, 2, 12, drafter=drafter(1, 4)).generate(ids, Request(40))
    assert out.token_ids == ar_run(model, ids, 40).token_ids
    assert out.stats.K < 30


def test_stage_caches_after_every_prune_equal_fresh_prefill(family_model, kept_children):
    from test_pipeline_tree import CheckedStages

    family, model = family_model
    ids = prompt(6, 9)
    emitted = []
    checked = CheckedStages(StagedTarget(model, 3), lambda: ids + emitted)
    decoder = flowspec(model, 3, 3, 4, 2, 10, executor=checked)
    for token in decoder.stream(ids, Request(30)):
        emitted.append(token)
    assert emitted == ar_run(model, ids, 30).token_ids
    assert checked.checked >= 3 and any(k is not None for k in kept_children), family


def test_flowspec_from_the_cli(capsys, tiny_target_dir, tmp_path):
    """`method=flowspec segment= tree_nodes= W= draft_source=` from generate equals AR; eval's replay over the
    target's traces equals the runtime step by step;
    a source it does not take is refused in one line."""
    from spd.cli import main

    common = [f"target={tiny_target_dir}", "prompt=What is 12*7? What is 12*7?", "max_new_tokens=16", "n=2"]
    assert main(["generate", *common, "method=flowspec", "W=2", "segment=3", "tree_nodes=8", "json=true"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "method=ar", "json=true"]) == 0
    assert tree["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert (tree["segment"], tree["tree_nodes"], tree["draft_source"]) == (3, 8, "suffix")
    assert main(["generate", *common, "method=flowspec", "draft_source=lookup", "json=true"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_source"] == "lookup"
    assert main(["generate", *common, "method=flowspec", "draft_source=module"]) == 2
    assert "suffix, lookup" in capsys.readouterr().err
    eval_replay_equals_runtime(main, capsys, tiny_target_dir, tmp_path, "method=flowspec")


@pytest.mark.parametrize("controller", ["own_process", "first_stage"])
def test_flowspec_over_stage_processes_equals_local(controller):
    """runtime=distributed: the tree and the segments' masks on the controller, the segments in the stage
    processes (each exiting node's logits, or greedy its argmax, sent back); greedy and seeded T = 1 tokens and
    every statistic equal the in-process run."""
    from helpers import GREEDY, controller_parts, distributed_runtime
    from spd.runtime.stages import open_stages
    from spd.verify.sampling import SamplingParams
    from spd.targets.loading import load_target

    tiny = load_target("tiny-llama")
    n, segment = 3, 3
    staged = StagedTarget(tiny.model, n)
    p = prompt(9, vocab=tiny.model.config.vocab_size)
    runs = [(GREEDY, 0), (SamplingParams(temperature=1.0), 1)]

    def decode(stages, params, seed):
        return flowspec(tiny.model, n, segment, 4, 2, 10, executor=stages).generate(p, Request(30, params, seed))

    local = [decode(staged, params, seed) for params, seed in runs]
    parts, cache = controller_parts("tiny-llama", n)
    with open_stages(parts, distributed_runtime(controller=controller), [], cache, width=2 * segment) as stages:
        remote = [decode(stages, params, seed) for params, seed in runs]
    for mine, theirs in zip(remote, local):
        assert mine.token_ids == theirs.token_ids
        assert mine.stats.as_dict() == theirs.stats.as_dict()
    assert local[0].token_ids == ar_run(tiny.model, p, 30).token_ids
    assert local[0].stats.rollbacks > 0 and any(r > 1 for r in local[0].stats.stage_rows)


@pytest.mark.parametrize("n, segment, width", [(2, 2, 1), (3, 3, 2)])
def test_trace_replay_equals_the_runtime(family_model, n, segment, width):
    """The exact greedy replay (the same loop over the target's cached trace instead of its stages): every step,
    acceptance and token of the runtime's."""
    from spd.eval.fast import record_greedy_trace
    from spd.eval.fast_trace import fast_segment_eval

    family, model = family_model
    for seed in range(2):
        ids = prompt(seed + 20, 10)
        runtime = flowspec(model, n, segment, 4, width, 10).generate(ids, Request(40))
        trace = record_greedy_trace(StagedTarget(model, 1), ids, 40, frozenset(), layers=[])
        replayed = fast_segment_eval(trace, make_drafter=lambda: NoisyTargetTrees(model), n=n, segment=segment,
                                     draft_length=4, width=width, tree_nodes=10,
                                     vocab=model.config.vocab_size)["stats"]
        assert runtime.stats.as_dict() == replayed.as_dict(), (family, seed)
        assert runtime.stats.rollbacks > 0


def test_reuse_equals_fresh(family_model):
    """One FlowSpec decoder (and one context drafter) across prompts that grow and shrink, greedy and T = 1: each
    generation's tokens and statistics equal a fresh decoder's."""
    from spd.verify.sampling import SamplingParams

    _, model = family_model
    reused = flowspec(model, 3, 3, 4, 2, 10, drafter=SuffixDrafter(1, 4))
    for i, (length, params) in enumerate([(12, None), (6, SamplingParams(temperature=1.0)), (9, None)]):
        ids = prompt(40 + i, length)
        request = Request(24, params or SamplingParams(), i)
        fresh = flowspec(model, 3, 3, 4, 2, 10, drafter=SuffixDrafter(1, 4)).generate(ids, request)
        again = reused.generate(ids, request)
        assert again.token_ids == fresh.token_ids and again.stats.as_dict() == fresh.stats.as_dict()
