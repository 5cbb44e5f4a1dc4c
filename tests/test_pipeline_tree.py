"""SPD's pipeline with draft trees (W > 1): each step a level of up to W nodes enters stage 1, the exiting node's
token picks the child whose subtree every stage keeps. Greedy output equals plain decoding on every tiny family for
SPD, PPSD and the output-state ablation; the caches after every prune equal fresh prefills of what they hold."""

import pytest
import torch

import spd.runtime.pipeline as pipeline
from spd.decoding import Request
from spd.drafters.spd_module import ModuleDrafter
from spd.models.module import SpeculationModule
from spd.runtime.flight import Flight
from spd.runtime.local import LocalStages
from spd.runtime.pipeline import PipelineDecoder
from spd.targets.kv_cache import LayerKVCache
from spd.targets.stages import StagedTarget
from spd.targets.tiny import FAMILIES, HYBRIDS, tiny_model

from helpers import count_kept_children, RankedDrafter, ar_run, prompt


def tree_decoder(model, n, width, method="spd", ranks=(0, 1, 3, 0, 2, 7), executor=None):
    staged = StagedTarget(model, n)
    module = SpeculationModule.from_target(staged, 1, seed=1, method=method)
    drafter = RankedDrafter(ModuleDrafter(module), model, list(ranks))
    return PipelineDecoder(executor or staged, drafter, frozenset(), width)


@pytest.fixture
def kept_children(monkeypatch):
    """The index of the child each verification kept (None: a correction)."""
    return count_kept_children(monkeypatch, pipeline)


@pytest.mark.parametrize("method", ["spd", "ppsd", "spd_output_state"])
def test_greedy_trees_equal_plain_decoding(family_model, method, kept_children):
    family, model = family_model
    for seed in range(2):
        ids = prompt(seed, 10)
        expected = ar_run(model, ids, 40).token_ids
        decoder = tree_decoder(model, 3, 4, method)
        out = decoder.generate(ids, Request(40))
        assert out.token_ids == expected, (family, method, seed)
    kept = [k for k in kept_children if k is not None]
    assert None in kept_children and 0 in kept and max(kept) >= 2    # corrections, first and later children kept
    assert out.stats.stage_rows[0] > out.stats.K                      # stage 1 ran levels of several nodes


def test_w1_flight_is_the_chain(family_model):
    """W = 1: node ids are positions, one row per stage per step, and the tokens equal plain decoding."""
    _, model = family_model
    ids = prompt(3, 10)
    decoder = tree_decoder(model, 3, 1, ranks=(0, 0, 5))
    out = decoder.generate(ids, Request(30))
    assert out.token_ids == ar_run(model, ids, 30).token_ids
    assert max(out.stats.stage_rows) <= out.stats.K and out.stats.restarts == 0
    flight = Flight(1)
    assert flight.seed(7, 1) == 7 and flight.enter(8, 7, flight.nodes[7].proposal) == 8


def test_chains_only_where_trees_are_not_built(family_model):
    from spd.drafters.reference import ReferenceDrafter

    _, model = family_model
    staged = StagedTarget(model, 2)
    with pytest.raises(ValueError, match="chains only"):
        PipelineDecoder(staged, ReferenceDrafter([1, 2, 3], 128), frozenset(), 4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["spd", "ppsd"])
def test_greedy_lookup_module_trees_equal_plain_decoding(family, method, kept_children):
    """draft_source=lookup+module at W = 4: a branch whose own context ends in a match gets the lookup's child,
    the others the module's (ranked as in the tests above); lookup children are kept and rejected, module children
    kept first and later, and the output is plain decoding's."""
    from spd.drafters.hybrid import LookupThenModule

    model = tiny_model(family, tied=False)    # its answers depend on the context: the lookup is right and wrong
    ids = prompt(0, 10)
    staged = StagedTarget(model, 3)
    module = ModuleDrafter(SpeculationModule.from_target(staged, 1, seed=1, method=method))
    ranked = RankedDrafter(module, model, [0, 1, 3, 0, 2, 7])   # the module's side keeps later children too
    out = PipelineDecoder(staged, LookupThenModule(ranked, 2, 4), frozenset(), 4).generate(ids, Request(40))
    assert out.token_ids == ar_run(model, ids, 40).token_ids
    sources = out.stats.sources                                 # source -> [verified, accepted]
    # the tiny hybrid settles into a cycle within a few tokens, where a lookup is never wrong: its rejected
    # lookup children are exercised on the attention families
    lookup_rejected = sources["lookup"][0] > sources["lookup"][1] or family in HYBRIDS
    assert lookup_rejected and sources["lookup"][1] > 0 and sources["module"][0] > 0, sources
    assert None in kept_children and any(k is not None and k >= 1 for k in kept_children)


class CheckedStages(LocalStages):
    """After every prune, each stage's cache equals a fresh prefill of what it holds: the verified tokens at their
    positions, then each kept tree node's row as its own branch would write it."""

    def __init__(self, target, tokens):
        super().__init__(target)
        self.tokens, self.checked = tokens, 0

    def launch(self, step, entering, flight=None):
        self.flight = flight
        super().launch(step, entering, flight)

    def prune(self, flight):
        super().prune(flight)
        verified = self.tokens()
        for stage, rows in enumerate(self.rows):
            layers = range(self.bounds[stage], self.bounds[stage + 1])
            slots = [verified[: slot + 1] for slot in range(rows.base)]
            for node, pos in rows.rows:
                if node in flight.nodes:
                    slots.append(verified[: flight.oldest] + [flight.token(a) for a in flight.branch(node)])
                else:
                    slots.append(verified[: pos + 1])
            for slot, seq in enumerate(slots):
                if slot < rows.base and slot < len(slots) - 1 and slot % 7:   # spot-check the verified rows
                    continue
                fresh = LayerKVCache(self.target.num_layers)
                self.target.forward_all(torch.tensor([seq]), fresh)
                for layer in (layer for layer in layers if self.cache.holds(layer, slot)):
                    # K/V rows, or a linear layer's states after the row (its last `rollback` positions)
                    for kept, want in zip(self.cache.memory(layer, slot), fresh.memory(layer)):
                        torch.testing.assert_close(kept, want, atol=1e-5, rtol=1e-4)
            self.checked += 1


def test_kv_after_prune_equals_fresh_prefill_at_every_stage(family_model):
    family, model = family_model
    ids = prompt(5, 9)
    emitted = []
    staged = StagedTarget(model, 3)
    checked = CheckedStages(staged, lambda: ids + emitted)
    decoder = tree_decoder(model, 3, 4, executor=checked, ranks=(1, 2, 0, 3, 1))
    for token in decoder.stream(ids, Request(24)):
        emitted.append(token)
    assert emitted == ar_run(model, ids, 24).token_ids
    assert checked.checked >= 3, family


def test_generate_and_eval_with_pipeline_trees(capsys, tiny_target_dir, tmp_path):
    """`W=4` reaches SPD's pipeline from the CLI (the stats line names it) and eval runs it step by step, every
    greedy sample checked against AR."""
    import json

    from spd.cli import main

    common = [f"target={tiny_target_dir}", "prompt=What is 12*7?", "max_new_tokens=16", "n=3"]
    assert main(["generate", *common, "method=spd", "W=4", "json=true"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "method=ar", "json=true"]) == 0
    assert tree["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"] and tree["W"] == 4
    assert main(["generate", *common, "method=spd", "W=4"]) == 0
    assert ", module W=4]" in capsys.readouterr().err
    out = str(tmp_path / "ev")
    assert main(["eval", f"target={tiny_target_dir}", f"output_dir={out}", f"trace_cache_dir={out}-traces", "n=3",
                 "method=ppsd", "W=4", "limit=1", "max_new_tokens=8", "wandb.mode=disabled"]) == 0
    capsys.readouterr()
    with open(f"{out}/samples.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["mode"] for r in rows] == ["runtime"] * 3 and all(r["ar_match"] for r in rows)


class ComparedDrafter(ModuleDrafter):
    """The batched pass over a level's tips, checked against one pass per branch at every step."""

    compared = 0

    def propose_branches(self, views, propose):
        batched = self.branch_logits(views)
        for view, logits in zip(views, batched):
            torch.testing.assert_close(logits, self.draft_logits(view), atol=1e-5, rtol=1e-4)
        self.compared += len(views) > 1
        return super().propose_branches(views, propose)


@pytest.mark.parametrize("method", ["spd", "ppsd"])
def test_batched_branch_drafts_equal_one_pass_per_branch(family_model, method):
    _, model = family_model
    staged = StagedTarget(model, 3)
    drafter = ComparedDrafter(SpeculationModule.from_target(staged, 1, seed=2, method=method))
    ids = prompt(11, 8)
    out = PipelineDecoder(staged, drafter, frozenset(), 4).generate(ids, Request(16))
    assert out.token_ids == ar_run(model, ids, 16).token_ids and drafter.compared > 3


def test_fixed_shape_executors_run_trees_like_local():
    """runtime=streams (and CUDA graphs, whose executor it extends) in its eager form on CPU: a chain-like level
    through the stage's fixed-shape step, a tree level eagerly into the same static cache; tokens and every
    statistic equal LocalStages', greedy and seeded T = 1. Gemma3: its sliding window is crossed in the static
    cache too."""
    from spd.runtime.streams import StreamStages
    from spd.verify.sampling import SamplingParams
    from spd.targets.tiny import tiny_model

    family, model = "gemma3", tiny_model("gemma3")
    for seed, params in [(0, SamplingParams()), (1, SamplingParams(temperature=1.0, top_k=8))]:
        ids = prompt(seed, 10)
        runs = []
        for stages in (None, StreamStages(StagedTarget(model, 3), cuda_graphs=False)):
            out = tree_decoder(model, 3, 4, executor=stages).generate(ids, Request(20, params, seed))
            s = out.stats
            runs.append((out.token_ids, s.K, s.rollbacks, s.restarts, s.stage_rows))
        assert runs[0] == runs[1], (family, seed)
        if params.greedy:
            assert runs[0][0] == ar_run(model, ids, 20).token_ids
        assert runs[0][4][0] > runs[0][1] and runs[0][3] + runs[0][2] > 0   # real tree levels, and misses
