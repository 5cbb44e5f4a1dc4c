"""The SPD decoding loop: an n-stage pipeline in which a drafter proposes one token per step.

Each step: the stages start (`launch`), the drafter reads G_t (the pipeline's *input* states) while they run
(or, for PPSD and the output-state ablation, the step's outputs once it is done), then the token leaving the last
stage yields the target's distribution for the next-oldest token, which is accepted or corrected (streaming
verification). A correction crops every cache, flushes the pipeline and
reseeds it. Who advances, who exits and what a rejection flushes come from `spd.runtime.schedule`; where the
stages run is the executor's business (`local.py`, `distributed/`), so this loop is the only copy.
"""

from __future__ import annotations

import torch

from spd.decoding import Decoder, Request, context_length, is_final
from spd.drafters.base import Drafter, step_view
from spd.metrics import DecodeStats
from spd.runtime.executor import StageExecutor
from spd.runtime.local import LocalStages
from spd.runtime.schedule import first_step, flushed_from, next_step, relay_step
from spd.sampling import Proposal, next_token, propose, settle
from spd.targets.stages import StagedTarget


def as_executor(stages: StagedTarget | StageExecutor) -> StageExecutor:
    return LocalStages(stages) if isinstance(stages, StagedTarget) else stages


class PipelineDecoder(Decoder):
    def __init__(self, stages: StagedTarget | StageExecutor, drafter: Drafter, eos_ids: frozenset[int]):
        self.executor = as_executor(stages)
        self.drafter = drafter
        self.eos_ids = eos_ids
        self.n = self.executor.n
        self.capture = frozenset(drafter.layers_needed(self.executor.bounds))

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        ex = self.executor
        self.stats = DecodeStats(n=self.n)
        try:
            yield from self._decode(prompt_ids, request)
        except GeneratorExit:   # the consumer stopped at a settled token: no step is in flight
            ex.finish()
            raise
        ex.finish()
        self.stats.finish()

    def _decode(self, prompt_ids: list[int], request: Request):
        ex, params, stats, max_new = self.executor, request.params, self.stats, request.max_new_tokens
        generator = request.generator(ex.device)
        # drafts run at most n positions past the last settled token before a verification can stop the run
        logits, captured = ex.prefill(prompt_ids, self.capture, context_length(len(prompt_ids), max_new, self.n + 1),
                                      params.greedy)
        self.drafter.start(captured, prompt_ids)
        first = next_token(logits, params, generator)
        tokens = list(prompt_ids) + [first]
        stats.N = 1
        yield first
        done = is_final(first, stats.N, max_new, self.eos_ids)
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
            yield token
            step = next_step(step, accepted)
            done = is_final(token, stats.N, max_new, self.eos_ids)


class PipelineARDecoder(Decoder):
    """Plain pipeline-parallel AR: each token relays through the n stages, one stage busy per step (AR where this
    process holds no decoder layer, or through the same fixed-shape steps)."""

    def __init__(self, stages: StagedTarget | StageExecutor, eos_ids: frozenset[int]):
        self.executor = as_executor(stages)
        self.eos_ids = eos_ids

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        ex = self.executor
        try:
            yield from self._decode(prompt_ids, request)
        except GeneratorExit:
            ex.finish()
            raise
        ex.finish()

    def _decode(self, prompt_ids: list[int], request: Request):
        ex, params = self.executor, request.params
        generator = request.generator(ex.device)
        logits, _ = ex.prefill(prompt_ids, frozenset(), context_length(len(prompt_ids), request.max_new_tokens, 0))
        token, produced = next_token(logits, params, generator), 1
        yield token
        while not is_final(token, produced, request.max_new_tokens, self.eos_ids):
            pos = len(prompt_ids) + produced - 1
            for stage in range(ex.n):
                ex.launch(relay_step(pos, stage, ex.n), ex.embed(token) if stage == 0 else None)
                result = ex.collect()
            token, produced = next_token(result.exit_logits, params, generator), produced + 1
            yield token
