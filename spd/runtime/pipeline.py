"""The SPD decoding loop: an n-stage pipeline in which a drafter proposes one token per step.

Each step: the stages start (`launch`), the drafter reads G_t (the pipeline's *input* states) while they run
(or, for PPSD and the output-state ablation, the step's outputs once it is done), then the token leaving the last
stage yields the target's distribution for the next-oldest token, which is accepted or corrected (streaming
verification). A correction crops every cache, flushes the pipeline and
reseeds it. Who advances, who exits and what a rejection flushes come from `spd.runtime.schedule`; where the
stages run is the executor's business (`local.py`, `distributed/`), so this loop is the only copy.
"""

from __future__ import annotations

import time

import torch

from spd.decoding import GenerationResult, context_length, is_final
from spd.drafters.base import Drafter, step_view
from spd.metrics import DecodeStats
from spd.runtime.executor import StageExecutor
from spd.runtime.local import LocalStages
from spd.runtime.schedule import first_step, flushed_from, next_step, relay_step
from spd.sampling import Proposal, SamplingParams, next_token, propose, settle
from spd.target.stages import StagedTarget


def as_executor(stages: StagedTarget | StageExecutor) -> StageExecutor:
    return LocalStages(stages) if isinstance(stages, StagedTarget) else stages


class PipelineDecoder:
    def __init__(self, stages: StagedTarget | StageExecutor, drafter: Drafter, params: SamplingParams,
                 eos_ids: frozenset[int]):
        self.executor = as_executor(stages)
        self.drafter = drafter
        self.params = params
        self.eos_ids = eos_ids
        self.n = self.executor.n
        self.capture = frozenset(drafter.layers_needed(self.executor.bounds))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 generator: torch.Generator | None = None, on_token=None) -> GenerationResult:
        """on_token(token_id): called for every token as it is settled (verified or corrected)."""
        ex, params = self.executor, self.params
        start = time.perf_counter()
        stats = DecodeStats(n=self.n)
        # drafts run at most n positions past the last settled token before a verification can stop the run
        logits, captured = ex.prefill(prompt_ids, self.capture,
                                      context_length(len(prompt_ids), max_new_tokens, self.n + 1), params.greedy)
        self.drafter.start(captured, prompt_ids)
        first = next_token(logits, params, generator)
        tokens = list(prompt_ids) + [first]
        stats.N = 1
        if on_token:
            on_token(first)
        done = is_final(first, stats.N, max_new_tokens, self.eos_ids)
        step = first_step(len(prompt_ids), self.n)
        features = {step.t: {0: ex.embed(first)}}     # pos -> {layer: H^l [1, 1, d]} of in-flight tokens
        drafts: dict[int, Proposal] = {}              # pos -> the proposal in flight there (its q, its source)

        def choose(logits):                           # a drafter's logits [V] -> the run's proposal
            return propose(logits, params, generator)

        while not done:
            t = step.t
            ex.launch(step, features[t][0] if step.runs(0) else None)
            if not self.drafter.after_step:
                proposal = self.drafter.draft(step_view(step, tokens, features), choose)
            out = ex.collect()
            for pos, captured in out.features.items():
                features[pos].update(captured)
            if self.drafter.after_step:
                proposal = self.drafter.draft(step_view(step, tokens, features, after=True), choose)
            stats.K += 1
            draft = proposal.token
            drafts[t + 1] = proposal
            tokens.append(draft)
            features[t + 1] = {0: ex.embed(draft)}
            if step.exiting is None:
                step = next_step(step, None)  # warm-up: nobody leaves the pipeline yet
                continue
            exited = step.exiting
            self.drafter.finalize(exited, features.pop(exited))
            candidate = step.candidate
            proposal = drafts.pop(candidate)
            verdict = out.exit_logits if out.exit_logits is not None else out.exit_argmax
            accepted, token = settle(verdict, proposal.token, proposal.q, params, generator)
            stats.settle(accepted, proposal.source)
            if not accepted:
                length = flushed_from(step)
                ex.rollback(length)
                self.drafter.on_rollback(length)
                del tokens[length:]
                tokens.append(token)
                features = {length: {0: ex.embed(token)}}
                drafts = {}
            if on_token:
                on_token(token)
            step = next_step(step, accepted)
            done = is_final(token, stats.N, max_new_tokens, self.eos_ids)
        ex.finish()
        stats.finish()
        generated = tokens[len(prompt_ids): len(prompt_ids) + stats.N]
        return GenerationResult(token_ids=generated, seconds=time.perf_counter() - start, stats=stats)


@torch.no_grad()
def pipeline_ar_generate(stages: StagedTarget | StageExecutor, prompt_ids: list[int], max_new_tokens: int,
                         params: SamplingParams, eos_ids: frozenset[int],
                         generator: torch.Generator | None = None, on_token=None) -> GenerationResult:
    """Plain pipeline-parallel AR: each token relays through the n stages, one stage busy per step."""
    ex = as_executor(stages)
    start = time.perf_counter()
    logits, _ = ex.prefill(prompt_ids, frozenset(), context_length(len(prompt_ids), max_new_tokens, 0))
    token = next_token(logits, params, generator)
    out = [token]
    if on_token:
        on_token(token)
    while not is_final(token, len(out), max_new_tokens, eos_ids):
        pos = len(prompt_ids) + len(out) - 1
        for stage in range(ex.n):
            ex.launch(relay_step(pos, stage, ex.n), ex.embed(token) if stage == 0 else None)
            result = ex.collect()
        token = next_token(result.exit_logits, params, generator)
        out.append(token)
        if on_token:
            on_token(token)
    ex.finish()
    return GenerationResult(token_ids=out, seconds=time.perf_counter() - start)
