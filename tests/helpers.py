"""Small builders shared by tests."""

import torch

from spd.ar import ar_generate
from spd.drafters.spd_module import ModuleDrafter
from spd.module import SpeculationModule
from spd.pipeline import PipelineDecoder
from spd.sampling import SamplingParams
from spd.target.stages import StagedTarget

GREEDY = SamplingParams()


def prompt(seed: int, length: int = 12, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (length,), generator=g).tolist()


def spd_run(model, n, prompt_ids, max_new, module_layers=1, use_cache=True, draft_vocab=None, params=GREEDY,
            eos=frozenset(), trace=False, seed=0, generator=None):
    staged = StagedTarget(model, n)
    module = SpeculationModule.from_target(staged, module_layers, draft_to_target=draft_vocab, seed=seed)
    decoder = PipelineDecoder(staged, ModuleDrafter(module, use_cache), params, eos, trace=trace)
    return decoder.generate(prompt_ids, max_new, generator), staged, module


def ar_run(model, prompt_ids, max_new, params=GREEDY, eos=frozenset(), generator=None):
    return ar_generate(StagedTarget(model, 1), prompt_ids, max_new, params, eos, generator)
