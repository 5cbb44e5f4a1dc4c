"""PipeDec (`method=pipedec`): a draft model as the pipeline's first stage grows the tree one layer per step — c
candidates per tip, the w best by cumulative log q — and the exiting node's token keeps one child's subtree in
every stage and in the draft model's own cache. Greedy output equals plain decoding on every tiny family, locally and
over stage processes; the draft model's cache after every step equals a fresh prefill of what it holds; a draft
model that is the whole target is always right."""

import json

import pytest
import torch

import spd.runtime.pipeline as pipeline
from helpers import count_kept_children, eval_replay_equals_runtime, GREEDY, ar_run, controller_parts, distributed_runtime, prompt
from spd.decoding import Request
from spd.drafters.draft_model import DraftLM, DraftModelDrafter
from spd.runtime.pipeline import PipelineDecoder
from spd.runtime.stages import open_stages
from spd.verify.sampling import SamplingParams
from spd.targets.kv_cache import LayerKVCache
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget


class NoisyLM(DraftLM):
    """A draft model whose logits get noise fixed by position: the tiny targets repeat one token, which their own
    early exit always gets right; with the noise its first, later and no child are right in turn."""

    def __call__(self, ids, positions, cache, visible=None):
        logits = super().__call__(ids, positions, cache, visible)
        g = torch.Generator().manual_seed(int(positions[0]))
        return logits + 1.5 * logits.std() * torch.randn(logits.shape, generator=g).to(logits)


def pipedec(model, n, width, children, layers, executor=None, drafter=None):
    staged = StagedTarget(model, n)
    drafter = drafter or DraftModelDrafter(NoisyLM(staged, layers))
    return PipelineDecoder(executor or staged, drafter, frozenset(), width, children, spine=False)


@pytest.fixture
def kept_children(monkeypatch):
    """The index of the child each verification kept (None: a correction)."""
    return count_kept_children(monkeypatch, pipeline)


@pytest.mark.parametrize("n, width, children", [(2, 1, 1), (3, 4, 2), (2, 6, 4)])
def test_greedy_pipedec_equals_plain_decoding(family_model, n, width, children, kept_children):
    family, model = family_model
    for seed in range(2):
        ids = prompt(seed, 10)
        out = pipedec(model, n, width, children, layers=1).generate(ids, Request(40))
        assert out.token_ids == ar_run(model, ids, 40).token_ids, (family, seed)
    kept = [k for k in kept_children if k is not None]
    assert None in kept_children and 0 in kept                    # corrections and kept drafts
    if width > 1:
        assert max(kept) >= 1                                     # later children kept
        assert out.stats.stage_rows[0] > out.stats.K              # levels of several nodes entered stage 1


def test_a_draft_model_that_is_the_target_is_always_right(family_model, kept_children):
    """draft_layers = every layer: the draft model computes the target's own logits, so at T = 0 its first child
    is kept at every verification (the draft model's tree cache, masks and pruning are exact)."""
    _, model = family_model
    ids = prompt(4, 9)
    staged = StagedTarget(model, 3)
    drafter = DraftModelDrafter(DraftLM(staged, model.config.num_hidden_layers))
    out = pipedec(model, 3, 4, 3, 0, drafter=drafter).generate(ids, Request(30))
    assert out.token_ids == ar_run(model, ids, 30).token_ids
    assert set(kept_children) == {0} and out.stats.rollbacks == 0 and out.stats.stage_rows[0] > out.stats.K


class CheckedDraftModel(DraftModelDrafter):
    """After every step, each row of the draft model's cache equals a fresh prefill of what it holds: the verified
    tokens at their positions, then each tree node's row as its own branch would write it."""

    def __init__(self, model: DraftLM, tokens):
        super().__init__(model)
        self.tokens, self.checked, self.pruned = tokens, 0, 0

    def propose_branches(self, views, propose):
        oldest = views[0].in_flight[0].pos
        before = {node for node, pos in getattr(self.rows, "rows", []) if pos >= oldest}
        out = super().propose_branches(views, propose)
        self.pruned += bool(before - {node for node, _ in self.rows.rows})     # rows of dropped nodes left
        branch = {}
        for view in views:
            for i, item in enumerate(view.in_flight):
                branch[item.node] = [x.token for x in view.in_flight[: i + 1]]
        verified = self.tokens()
        seqs = [verified[: slot + 1] for slot in range(self.rows.base)]
        seqs += [verified[:oldest] + branch[node] for node, _ in self.rows.rows]
        staged, layers = self.model.staged, self.model.layers
        for slot in [*range(0, self.rows.base, 5), *range(self.rows.base, len(seqs))]:
            fresh = LayerKVCache(staged.num_layers)
            staged.run_layers(staged.embed(torch.tensor([seqs[slot]])), torch.arange(len(seqs[slot])), 0, layers,
                              fresh)
            for layer in (layer for layer in range(layers) if self.cache.holds(layer, slot)):
                for kept, want in zip(self.cache.memory(layer, slot), fresh.memory(layer)):
                    torch.testing.assert_close(kept, want, atol=1e-5, rtol=1e-4)
        self.checked += 1
        return out


def test_draft_model_cache_after_every_prune_equals_fresh_prefill(family_model, kept_children):
    family, model = family_model
    ids = prompt(5, 9)
    emitted = []
    staged = StagedTarget(model, 3)
    drafter = CheckedDraftModel(NoisyLM(staged, 2), lambda: ids + emitted)
    decoder = pipedec(model, 3, 4, 2, 2, drafter=drafter)
    for token in decoder.stream(ids, Request(24)):
        emitted.append(token)
    assert emitted == ar_run(model, ids, 24).token_ids
    assert drafter.checked >= 10 and drafter.pruned and None in kept_children, family
    assert any(k is not None and k >= 1 for k in kept_children)


def test_target_stages_after_pipedec_prunes_equal_fresh_prefill(family_model):
    from test_pipeline_tree import CheckedStages

    family, model = family_model
    ids = prompt(6, 9)
    emitted = []
    checked = CheckedStages(StagedTarget(model, 3), lambda: ids + emitted)
    decoder = pipedec(model, 3, 4, 4, model.config.num_hidden_layers - 1, executor=checked)
    for token in decoder.stream(ids, Request(24)):
        emitted.append(token)
    assert emitted == ar_run(model, ids, 24).token_ids
    assert checked.checked >= 3, family


@pytest.mark.parametrize("controller", ["own_process", "first_stage"])
def test_pipedec_over_stage_processes_equals_local(controller):
    """runtime=distributed: the draft model on the controller, the tree levels in the stage processes; greedy and
    seeded T = 1 tokens and every statistic equal the in-process run."""
    tiny = load_target("tiny-llama")
    n = 2
    staged = StagedTarget(tiny.model, n)
    p = prompt(9, vocab=tiny.model.config.vocab_size)
    runs = [(GREEDY, 0), (SamplingParams(temperature=1.0), 1)]

    def decode(stages, params, seed):
        decoder = pipedec(tiny.model, n, 4, 2, 1, executor=stages,
                          drafter=DraftModelDrafter(NoisyLM(staged, 1)))
        return decoder.generate(p, Request(30, params, seed))

    local = [decode(staged, params, seed) for params, seed in runs]
    parts, cache = controller_parts("tiny-llama", n)
    with open_stages(parts, distributed_runtime(controller=controller), [], cache, width=4) as stages:
        remote = [decode(stages, params, seed) for params, seed in runs]
    for mine, theirs in zip(remote, local):
        assert mine.token_ids == theirs.token_ids
        assert mine.stats.as_dict() == theirs.stats.as_dict()
    assert local[0].token_ids == ar_run(tiny.model, p, 30).token_ids
    assert local[0].stats.stage_rows[0] > local[0].stats.K and local[0].stats.rollbacks > 0


def test_pipedec_from_the_cli(capsys, tiny_target_dir, tmp_path):
    """`method=pipedec W= children= draft_layers=` from generate equals AR; eval replays it over the
    target's traces exactly as the runtime runs it; bad keys are refused in one line."""
    from spd.cli import main

    common = [f"target={tiny_target_dir}", "prompt=What is 12*7?", "max_new_tokens=16", "n=2"]
    assert main(["generate", *common, "method=pipedec", "W=4", "children=2", "draft_layers=1", "json=true"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "method=ar", "json=true"]) == 0
    assert tree["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert (tree["W"], tree["children"], tree["draft_layers"], tree["draft_source"]) == (4, 2, 1, None)
    assert main(["generate", *common, "method=pipedec", "draft_layers=99"]) == 2
    assert "draft_layers=99" in capsys.readouterr().err
    assert main(["generate", *common, "method=pipedec", "checkpoint=somewhere"]) == 2
    assert "drop checkpoint=" in capsys.readouterr().err
    assert main(["generate", *common, "method=lookup", "children=2"]) == 2
    assert "children=2" in capsys.readouterr().err
    eval_replay_equals_runtime(main, capsys, tiny_target_dir, tmp_path, "method=pipedec", "W=4", "children=2")


def test_trace_replay_equals_the_runtime(family_model):
    """PipeDec's exact greedy replay: its draft model runs, the target's stages are read from the cached trace; every
    step, acceptance and token equals the runtime's."""
    from spd.eval.fast import record_greedy_trace
    from spd.eval.fast_trace import fast_pipedec_eval

    family, model = family_model
    for seed in range(2):
        ids = prompt(seed + 30, 10)
        runtime = pipedec(model, 3, 4, 2, 1).generate(ids, Request(40))
        trace = record_greedy_trace(StagedTarget(model, 1), ids, 40, frozenset(), layers=[])
        replayed = fast_pipedec_eval(trace, make_drafter=lambda: DraftModelDrafter(NoisyLM(StagedTarget(model, 3), 1)),
                                     n=3, width=4, children=2, vocab=model.config.vocab_size)["stats"]
        assert runtime.stats.as_dict() == replayed.as_dict(), (family, seed)
        assert runtime.stats.rollbacks > 0


def test_reuse_equals_fresh(family_model):
    """One PipeDec decoder and draft model across prompts that grow and shrink, greedy and T = 1: each generation's
    tokens and statistics equal a fresh decoder's."""
    _, model = family_model
    reused = pipedec(model, 3, 4, 2, 1)
    for i, (length, params) in enumerate([(12, GREEDY), (6, SamplingParams(temperature=1.0)), (9, GREEDY)]):
        ids = prompt(50 + i, length)
        request = Request(24, params, i)
        fresh = pipedec(model, 3, 4, 2, 1).generate(ids, request)
        again = reused.generate(ids, request)
        assert again.token_ids == fresh.token_ids and again.stats.as_dict() == fresh.stats.as_dict()


def test_sequences_sharing_the_stages_decode_as_each_would_alone(family_model):
    """SEED's schedule (generate prompts_file=, serve): PipeDec's sequences share one pipeline, each with its own
    draft model cache; each one's tokens and statistics equal its solo decode."""
    from spd.runtime.seed import SeedDecoder

    _, model = family_model
    staged = StagedTarget(model, 3)

    def make():
        return DraftModelDrafter(NoisyLM(staged, 1))

    prompts = [prompt(60 + i, length) for i, length in enumerate([5, 12, 8, 9])]
    lengths = [20, 30, 16, 24]
    solo = [PipelineDecoder(staged, make(), frozenset(), 4, 2, spine=False).generate(p, Request(n, GREEDY))
            for p, n in zip(prompts, lengths)]
    seed = SeedDecoder(staged, make, frozenset(), 4, max_batch=3, children=2, spine=False)
    tickets = [seed.submit(p, Request(n, GREEDY)) for p, n in zip(prompts, lengths)]
    seed.run()
    assert seed.hub.rows > seed.hub.forwards
    for ticket, ref in zip(tickets, solo):
        assert ticket.tokens == ref.token_ids and ticket.stats.as_dict() == ref.stats.as_dict()
