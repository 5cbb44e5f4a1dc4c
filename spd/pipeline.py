"""The single-process SPD runtime: an n-stage pipeline in which a drafter proposes one token per step.

Each step: the drafter reads G_t (the pipeline's *input* states) while every in-flight token advances one stage;
the token leaving the last stage yields the target's distribution for the next-oldest token, which is accepted
or corrected (streaming verification). A correction truncates every cache, flushes the pipeline and reseeds it.
`advance`, `settle` and `rollback` are the per-step pieces a multi-process runtime reuses stage by stage.
"""

from __future__ import annotations

import time

import torch

from spd.decoding import GenerationResult, is_final, prefill
from spd.drafters.base import Drafter, Slot
from spd.layout import needed_layers
from spd.metrics import DecodeStats
from spd.sampling import SamplingParams, greedy_token, next_token, sample, verify_greedy, verify_sampled, warp
from spd.target.kv_cache import LayerKVCache
from spd.target.stages import StagedTarget


class PipelineDecoder:
    def __init__(self, target: StagedTarget, drafter: Drafter, params: SamplingParams, eos_ids: frozenset[int],
                 trace: bool = False):
        self.target = target
        self.drafter = drafter
        self.params = params
        self.eos_ids = eos_ids
        self.n = target.n
        self.capture = frozenset(needed_layers(target.bounds))
        self.trace = trace

    # ------------------------------------------------------------ per-step pieces
    def new_slot(self, token: int, pos: int, q: torch.Tensor | None = None) -> Slot:
        h0 = self.target.embed(torch.tensor([[token]], device=self.target.device))
        return Slot(token=token, pos=pos, depth=0, hidden=h0, captured={0: h0}, q=q)

    def advance(self, slot: Slot, cache: LayerKVCache) -> None:
        """Run the slot through its next stage (on a real pipeline each stage does this on its own device)."""
        positions = torch.tensor([slot.pos], device=self.target.device)
        slot.hidden, captured = self.target.run_stage(slot.depth, slot.hidden, positions, cache, self.capture)
        slot.captured.update(captured)
        slot.depth += 1

    def propose(self, draft_logits: torch.Tensor, generator) -> tuple[int, torch.Tensor | None]:
        """The draft token and, when sampling, the warped q it was drawn from."""
        if self.params.greedy:
            return greedy_token(draft_logits), None
        q = warp(draft_logits, self.params)
        return sample(q, generator), q

    def settle(self, exited: Slot, candidate: Slot, generator) -> tuple[bool, int]:
        """Verify the next-oldest token against the distribution the exiting token gives."""
        logits = self.target.logits(exited.hidden[0, -1])
        if self.params.greedy:
            return verify_greedy(candidate.token, logits)
        return verify_sampled(candidate.token, warp(logits, self.params), candidate.q, generator)

    def rollback(self, cache: LayerKVCache, tokens: list[int], pos: int, correction: int) -> list[Slot]:
        """Truncate every layer's cache to the verified prefix, flush in-flight states, reseed with the correction."""
        cache.crop(pos)
        del tokens[pos:]
        tokens.append(correction)
        return [self.new_slot(correction, pos)]

    # ------------------------------------------------------------ the step loop
    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 generator: torch.Generator | None = None) -> GenerationResult:
        start = time.perf_counter()
        stats = DecodeStats(n=self.n)
        cache, hidden, captured = prefill(self.target, prompt_ids, self.capture)
        self.drafter.start(captured, prompt_ids)
        first = next_token(self.target.logits(hidden[0, -1]), self.params, generator)
        tokens = list(prompt_ids) + [first]
        stats.N = 1
        trace: list[dict] = []
        done = is_final(first, stats.N, max_new_tokens, self.eos_ids)
        slots = [self.new_slot(first, len(prompt_ids))]
        while not done:
            t, occupancy = slots[-1].pos, len(slots)
            draft_logits = self.drafter.draft_logits(t, occupancy, slots)  # concurrent with the step below
            if self.trace:
                trace.append({"t": t, "a": occupancy, "tokens": tokens[: t + 1], "logits": draft_logits})
            for slot in slots:
                self.advance(slot, cache)
            stats.K += 1
            draft, q = self.propose(draft_logits, generator)
            tokens.append(draft)
            slots.append(self.new_slot(draft, t + 1, q))
            if slots[0].depth < self.n:
                continue  # warm-up: nobody leaves the pipeline yet
            exited = slots.pop(0)
            self.drafter.finalize(exited.pos, exited.captured)
            candidate = slots[0]
            accepted, token = self.settle(exited, candidate, generator)
            stats.settle(accepted)
            if not accepted:
                slots = self.rollback(cache, tokens, candidate.pos, token)
            done = is_final(token, stats.N, max_new_tokens, self.eos_ids)
        stats.finish()
        generated = tokens[len(prompt_ids): len(prompt_ids) + stats.N]
        return GenerationResult(token_ids=generated, seconds=time.perf_counter() - start, stats=stats, trace=trace)
