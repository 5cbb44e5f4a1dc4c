"""Reuse equals fresh: several generations on one executor / one set of stage processes / one drafter
give, each of them, what a fresh decoder gives on the same prompt — for every executor (in-process, the
fixed-shape graph and stream executors in their eager CPU form, one process per stage), every method (SPD, PPSD,
output states, pipeline AR, EAGLE-3's chain, the lookup chain, AR), greedy and seeded T = 1.

The plan of generations is what hid the bug before: prompts that grow and shrink between generations,
generations that end on an accepted draft and on a rejected one, on the length limit and on EOS, and one that
stops after the prefill's token. `ScriptedDrafter` drafts the target's own token except at every position divisible
by WRONG_EVERY, so under greedy decoding where a generation ends on a rejection is known in advance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from helpers import GREEDY, ScriptedDrafter, ar_run, controller_parts, distributed_runtime, ended_on_rejection, prompt
from spd.runtime.ar import ARDecoder
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.spd_module import ModuleDrafter
from spd.models.eagle3 import Eagle3Module
from spd.models.module import SpeculationModule
from spd.runtime.chain import ChainDecoder
from spd.runtime.local import LocalStages
from spd.runtime.pipeline import PipelineARDecoder, PipelineDecoder
from spd.runtime.stages import open_stages
from spd.runtime.streams import GraphStages, StreamStages
from spd.verify.sampling import Proposal, SamplingParams
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
WRONG_EVERY = 5
N_STAGES = 3
DRAFTING = ("spd", "ppsd", "spd_output_state")


@dataclass(frozen=True)
class Gen:
    seed: int
    length: int                # prompt tokens
    max_new: int
    eos: str | None = None     # stop on EOS at a position whose draft is "accepted" / "rejected"; None: length limit


# Greedy token j of a generation sits at position P + j and settles the draft made for it: rejected iff
# (P + j) % WRONG_EVERY == 0. So the first generation (6 + 4 = 10) ends on a rejection and the next prompt is 50
# tokens longer than the 10 positions that rejection keeps — the case that cut a reused distributed pipeline's fresh
# caches back to the old length; the sixth (33 + 17 = 50) ends on one before a 70-token prompt.
PLAN = (Gen(1, 6, 5), Gen(2, 60, 20), Gen(3, 8, 1), Gen(4, 20, 30, "rejected"), Gen(5, 6, 30, "accepted"),
        Gen(6, 33, 18), Gen(7, 70, 26))


@pytest.fixture(scope="module")
def tiny(untied_target_dir):
    return load_target(untied_target_dir)


@pytest.fixture(scope="module")
def plan(tiny):
    """[(prompt ids, max_new_tokens, eos ids)] and each generation's greedy reference (the target's own decode)."""
    vocab = tiny.model.config.vocab_size
    out = []
    for gen in PLAN:
        ids = prompt(gen.seed, gen.length, vocab)
        eos = frozenset()
        if gen.eos:
            full = ar_run(tiny.model, ids, gen.max_new).token_ids
            eos = frozenset({eos_token(full, gen.length, gen.eos == "rejected")})
        out.append((ids, gen.max_new, eos, ar_run(tiny.model, ids, gen.max_new, eos=eos).token_ids))
    return out


def eos_token(answer: list[int], prompt_len: int, rejected: bool) -> int:
    """A token of the target's own answer whose first occurrence (index j >= 3) settles a draft that the scripted
    drafter gets wrong (rejected) or right: making it EOS ends the generation there."""
    for j, token in enumerate(answer):
        if j >= 3 and answer.index(token) == j and ((prompt_len + j) % WRONG_EVERY == 0) == rejected:
            return token
    raise AssertionError("no such token in the answer; change the plan's seeds")


def modules(staged: StagedTarget) -> dict[str, SpeculationModule]:
    return {method: SpeculationModule.from_target(staged, 1, seed=i, method=method).eval()
            for i, method in enumerate(DRAFTING)}


def decode_plan(plan, params, decode) -> list:
    """decode(ids, max_new, eos, seed) for each generation in order, seeded per generation."""
    return [decode(ids, max_new, eos, 100 + i)
            for i, (ids, max_new, eos, _) in enumerate(plan)]


def check_reuse_equals_fresh(plan, params, reused, fresh, drafting: bool):
    for i, (mine, theirs, (ids, max_new, eos, greedy_ref)) in enumerate(zip(reused, fresh, plan)):
        assert mine.token_ids == theirs.token_ids, f"generation {i}: reused differs from fresh"
        if mine.stats is not None:
            assert mine.stats.as_dict() == theirs.stats.as_dict(), i
        if params.greedy:
            assert mine.token_ids == greedy_ref, f"generation {i}: not the target's own greedy decode"
    if params.greedy and drafting:
        # the plan covers what it says: ends on an accepted and a rejected draft, on the length limit and on EOS
        ends = {(ended_on_rejection(r), r.token_ids[-1] in eos)
                for r, (_, _, eos, _) in zip(reused, plan) if len(r.token_ids) > 1}
        assert ends == {(False, False), (False, True), (True, False), (True, True)}, ends
        assert any(r.stats.rollbacks > 0 for r in reused) and len(reused[2].token_ids) == 1
    if drafting:
        assert sum(r.stats.rollbacks for r in reused) > 0
        assert sum(r.stats.N - 1 - r.stats.rollbacks for r in reused) > 0   # accepted drafts too


def pipelined(method: str, executor, staged_full: StagedTarget, module, model, params):
    """A decode function over one executor (and, for drafting methods, one drafter) that every call reuses."""
    if method == "pipeline_ar":
        return lambda ids, max_new, eos, seed: PipelineARDecoder(executor, eos).generate(ids, Request(max_new, params, seed))
    drafter = ScriptedDrafter(ModuleDrafter(module), model, WRONG_EVERY)
    return lambda ids, max_new, eos, seed: PipelineDecoder(executor, drafter, eos).generate(ids, Request(max_new, params, seed))


def fresh_pipelined(method, staged_full, module, model, params):
    """A new in-process executor and drafter for every generation: the oracle."""
    def decode(ids, max_new, eos, seed):
        return pipelined(method, LocalStages(staged_full), staged_full, module, model, params)(ids, max_new, eos, seed)
    return decode


EXECUTORS = {"local": LocalStages, "graphs": GraphStages, "streams": StreamStages}


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T1"])
@pytest.mark.parametrize("method", [*DRAFTING, "pipeline_ar"])
@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_a_reused_in_process_executor_decodes_like_a_fresh_one(tiny, plan, executor, method, params):
    staged = StagedTarget(tiny.model, N_STAGES)
    module = modules(staged).get(method)
    stages = EXECUTORS[executor](staged)
    reused = decode_plan(plan, params, pipelined(method, stages, staged, module, tiny.model, params))
    fresh = decode_plan(plan, params, fresh_pipelined(method, staged, module, tiny.model, params))
    check_reuse_equals_fresh(plan, params, reused, fresh, method != "pipeline_ar")


@pytest.fixture(scope="module")
def distributed(tiny, untied_target_dir):
    """One set of stage processes for every method of the test below, announced every method's layers."""
    staged = StagedTarget(tiny.model, N_STAGES)
    mods = modules(staged)
    capture = sorted({layer for m in mods.values() for layer in ModuleDrafter(m).layers_needed(staged.bounds)})
    controller, cache = controller_parts(untied_target_dir, N_STAGES)
    with open_stages(controller, distributed_runtime(), capture, cache) as stages:
        yield stages, staged, mods


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T1"])
@pytest.mark.parametrize("method", [*DRAFTING, "pipeline_ar"])
def test_reused_stage_processes_decode_like_a_fresh_pipeline(tiny, plan, distributed, method, params):
    """The same processes serve every method and temperature in turn (module scope), each generation equal to a
    fresh in-process decoder's (runtime=distributed = runtime=local is tests/test_distributed.py's)."""
    stages, staged, mods = distributed
    module = mods.get(method)
    reused = decode_plan(plan, params, pipelined(method, stages, staged, module, tiny.model, params))
    fresh = decode_plan(plan, params, fresh_pipelined(method, staged, module, tiny.model, params))
    check_reuse_equals_fresh(plan, params, reused, fresh, method != "pipeline_ar")


class ScriptedChainDrafter(Eagle3Drafter):
    """EAGLE-3's drafter (its passes and cache run for real) whose drafts are the target's own tokens, reversed at
    every position divisible by WRONG_EVERY: chains with accepted prefixes and misses."""

    def __init__(self, module, embed, model):
        super().__init__(module, embed)
        self.model = model

    def start(self, prompt_hidden, tokens):
        self.seq = list(tokens)
        super().start(prompt_hidden, tokens)

    def observe(self, hidden, tokens):
        self.seq = list(tokens)
        super().observe(hidden, tokens)

    @torch.no_grad()
    def chain(self, m, choose):
        super().chain(m, lambda logits: Proposal(int(logits.argmax())))
        seq, drafts = list(self.seq), []
        for _ in range(m):
            logits = self.model(torch.tensor([seq])).logits[0, -1]
            drafts.append(choose(-logits if len(seq) % WRONG_EVERY == 0 else logits))
            seq.append(drafts[-1].token)
        return drafts


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T1"])
@pytest.mark.parametrize("drafter", ["eagle3", "lookup"])
def test_a_reused_chain_drafter_decodes_like_a_fresh_one(tiny, plan, params, drafter):
    staged = StagedTarget(tiny.model, 1)
    module = Eagle3Module.from_target(staged, seed=0).eval()

    def make():
        return ScriptedChainDrafter(module, staged.embed, tiny.model) if drafter == "eagle3" else LookupDrafter(1, 4)

    one = make()   # reused, as `spd-infer chat` reuses its drafter

    def reuse(ids, max_new, eos, seed):
        return ChainDecoder(staged, one, eos, 3).generate(ids, Request(max_new, params, seed))

    def fresh(ids, max_new, eos, seed):
        return ChainDecoder(staged, make(), eos, 3).generate(ids, Request(max_new, params, seed))

    reused, fresh_runs = decode_plan(plan, params, reuse), decode_plan(plan, params, fresh)
    check_reuse_equals_fresh(plan, params, reused, fresh_runs, drafting=False)
    if params.greedy or drafter == "eagle3":   # sampled text rarely repeats itself: the lookup finds little to copy
        assert sum(r.stats.accepted for r in reused) > 0
    assert any(count < 3 for r in reused for count in r.stats.accepted_per_cycle)   # misses too


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T1"])
def test_ar_decodes_like_a_fresh_ar(tiny, plan, params):
    staged = StagedTarget(tiny.model, 1)
    ar = decode_plan(plan, params, lambda ids, max_new, eos, seed: ARDecoder(staged, eos).generate(ids, Request(max_new, params, seed)))
    ar_fresh = decode_plan(plan, params, lambda ids, max_new, eos, seed: ARDecoder(StagedTarget(tiny.model, 1), eos).generate(
        ids, Request(max_new, params, seed)))
    check_reuse_equals_fresh(plan, params, ar, ar_fresh, drafting=False)


def cancelled_then_whole(decoder, plan, params) -> list:
    """Every generation of the plan twice on one decoder: first a stream closed after a few tokens (a client that
    hangs up), then the whole decode, whose result is returned."""
    out = []
    for i, (ids, max_new, eos, _) in enumerate(plan):
        decoder.eos_ids = eos
        stream = decoder.stream(ids, Request(max_new, params, 900 + i))
        taken = [token for _, token in zip(range(1 + i % 4), stream)]
        stream.close()
        assert taken
        out.append(decoder.generate(ids, Request(max_new, params, 100 + i)))
    return out


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T1"])
@pytest.mark.parametrize("where", ["local", "distributed", "chain", "ar"])
def test_a_stream_closed_part_way_leaves_the_decoder_clean(tiny, plan, distributed, where, params):
    """Cancellation is closing the stream at a verified token: the next decode on the same executor /
    stage processes / drafter equals a fresh decoder's."""
    stages, staged, mods = distributed
    if where in ("local", "distributed"):
        executor = LocalStages(staged) if where == "local" else stages
        decoder = PipelineDecoder(executor, ScriptedDrafter(ModuleDrafter(mods["spd"]), tiny.model, WRONG_EVERY),
                                  frozenset())
        fresh = decode_plan(plan, params, fresh_pipelined("spd", staged, mods["spd"], tiny.model, params))
    elif where == "chain":
        whole = StagedTarget(tiny.model, 1)
        decoder = ChainDecoder(whole, LookupDrafter(1, 4), frozenset(), 3)
        fresh = decode_plan(plan, params, lambda ids, max_new, eos, seed: ChainDecoder(
            whole, LookupDrafter(1, 4), eos, 3).generate(ids, Request(max_new, params, seed)))
    else:
        decoder = ARDecoder(StagedTarget(tiny.model, 1), frozenset())
        fresh = decode_plan(plan, params, lambda ids, max_new, eos, seed: ARDecoder(
            StagedTarget(tiny.model, 1), eos).generate(ids, Request(max_new, params, seed)))
    check_reuse_equals_fresh(plan, params, cancelled_then_whole(decoder, plan, params), fresh,
                             drafting=where in ("local", "distributed"))
