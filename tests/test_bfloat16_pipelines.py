"""The pipelined decoders in bfloat16 on a CPU, whose targets attend through row-invariant attention
(spd.targets.invariant_attention): SPD (a random module behind the lookup), PipeDec (a draft model growing trees),
FlowSpec (segments of context-statistics trees) and SEED's shared pipeline decode the target's own greedy tokens,
exactly, however many rows and sequences share a stage's forward."""

import pytest

from helpers import GREEDY, ar_run, prompt
from spd.decoding import Request
from spd.drafters.draft_model import DraftLM, DraftModelDrafter
from spd.drafters.hybrid import LookupThenModule
from spd.drafters.spd_module import ModuleDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineDecoder
from spd.runtime.seed import SeedDecoder
from spd.runtime.segments import SegmentPipelineDecoder
from spd.targets import invariant_attention
from spd.targets.stages import StagedTarget
from test_invariant_attention import bf16_model

FAMILIES = ["llama", "qwen3", "gemma3"]


def decoders(staged: StagedTarget, module: SpeculationModule):
    return {"spd": PipelineDecoder(staged, LookupThenModule(ModuleDrafter(module), 1, 3), frozenset()),
            "spd W=2": PipelineDecoder(staged, LookupThenModule(ModuleDrafter(module), 1, 3), frozenset(), 2),
            "pipedec": PipelineDecoder(staged, DraftModelDrafter(DraftLM(staged, 1)), frozenset(), 4, 2, spine=False),
            "flowspec": SegmentPipelineDecoder(staged, SuffixDrafter(1, 4), frozenset(), 2, 4, 2, 6)}


@pytest.mark.parametrize("family", FAMILIES)
def test_pipelines_decode_ar_greedy_in_bfloat16(family):
    """Tied, the target repeats itself and the drafts are kept; untied, the random module and draft model miss."""
    kept, rolled = {}, {}
    for tied in (True, False):
        model = bf16_model(family, seed=3, tied=tied)
        staged = StagedTarget(model, 3)
        assert model.config._attn_implementation == invariant_attention.KERNEL
        module = SpeculationModule.from_target(staged, 1, seed=0)
        for name, decoder in decoders(staged, module).items():
            for seed in range(2):
                p = prompt(seed + 60, 9 + 6 * seed, model.config.vocab_size)
                out = decoder.generate(p, Request(40, GREEDY))
                assert out.token_ids == ar_run(model, p, 40).token_ids, (family, tied, name, seed)
                kept[name] = kept.get(name, 0) + sum(out.stats.accepted_runs)
                rolled[name] = rolled.get(name, 0) + out.stats.rollbacks
    assert all(kept[name] > 5 and rolled[name] > 0 for name in kept), (kept, rolled)


def test_seed_shares_a_bfloat16_pipeline_and_each_sequence_decodes_ar():
    model = bf16_model("llama", seed=4, tied=True)
    staged = StagedTarget(model, 2)
    module = SpeculationModule.from_target(staged, 1, seed=0)
    seed = SeedDecoder(staged, lambda: LookupThenModule(ModuleDrafter(module), 1, 3), frozenset(), max_batch=3)
    prompts = [prompt(80 + i, 4 + 5 * i, model.config.vocab_size) for i in range(4)]
    tickets = [seed.submit(p, Request(30, GREEDY)) for p in prompts]
    seed.run()
    assert seed.hub.rows > seed.hub.forwards                  # several sequences' rows in a stage's forward
    for i, (ticket, p) in enumerate(zip(tickets, prompts)):
        assert ticket.tokens == ar_run(model, p, 30).token_ids, i
