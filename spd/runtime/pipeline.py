"""The SPD decoding loop: an n-stage pipeline in which a drafter proposes one token per step.

Each step: the stages start (`launch`), the drafter reads G_t (the pipeline's *input* states) while they run
(or, for PPSD and the output-state ablation, the step's outputs once it is done), then the token leaving the last
stage yields the target's distribution for the next-oldest token, which is accepted or corrected (streaming
verification). A correction crops every cache, flushes the pipeline and
reseeds it. Who advances, who exits and what a rejection flushes come from `spd.runtime.schedule`; where the
stages run is the executor's business (`local.py`, `distributed/`), so this loop is the only copy.

With W > 1 (draft trees, design §8) each position in flight is a tree level (`spd.runtime.flight`): the module
drafts for every tip of the newest level, `grow` enters the next level, and the exiting node's verdict keeps one
child's subtree in every stage. W = 1 is the same loop over a chain whose node ids are its positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from spd.decoding import Decoder, Request, context_length, is_final
from spd.drafters.base import AFTER_STEP, ROLLBACK, TREES, Drafter, StepView, propose_level
from spd.metrics import DecodeStats
from spd.runtime.executor import StageExecutor
from spd.runtime.flight import Flight
from spd.runtime.local import LocalStages
from spd.runtime.schedule import first_step, flushed_from, next_step, relay_step
from spd.runtime.views import branch_view
from spd.verify.sampling import Proposal, next_token, propose, propose_children, settle_children
from spd.targets.stages import StagedTarget


SHARED_STEP = object()   # in a shared pipeline's stream: this sequence's step is launched, waiting for the others'


@dataclass(frozen=True)
class DraftWanted:
    """In a shared pipeline's stream: this sequence's draft, made with the other sequences' (spd.runtime.seed sends
    the proposal back)."""
    drafter: Drafter
    view: StepView
    propose: Callable


def as_executor(stages: StagedTarget | StageExecutor) -> StageExecutor:
    return LocalStages(stages) if isinstance(stages, StagedTarget) else stages


def finishing(executor: StageExecutor, tokens):
    """Yield a decode's `tokens` over `executor`, which is told the generation ended when they do or when the
    consumer stops (at a settled token: no step is in flight)."""
    try:
        yield from tokens
    except GeneratorExit:
        executor.finish()
        raise
    executor.finish()


def grow(flight: Flight, pos: int, options: list[tuple[int, Proposal, float]], spine: bool = True) -> None:
    """Enter the next level from every tip's candidate children (tip, proposal, log q), each tip's in rank order:
    the W whose branches have the highest cumulative log q (PipeDec's rule, and the SPD paper's). spine: the spine
    tip's likeliest child always enters, with the W - 1 best others — a kept child whose every descendant lost to
    other branches would refill the pipeline, and on SmolLM2 those refills cost more than the tree won for SPD's
    module (docs/rivals.md, "SPD's pipeline trees"). W = 1: the chain's one draft."""
    score = lambda o: flight.nodes[o[0]].score + o[2]                  # noqa: E731
    ranked = sorted(options, key=lambda o: -score(o))
    first = next(o for o in options if o[0] == flight.spine) if spine else ranked[0]
    chosen = [first, *(o for o in ranked if o is not first)][: flight.width]
    for option in sorted(chosen, key=lambda o: -score(o)):
        tip, proposal, log_q = option
        node = flight.enter(pos, tip, proposal, score(option))
        if option is first:
            flight.spine = node


class PipelineDecoder(Decoder):
    def __init__(self, stages: StagedTarget | StageExecutor, drafter: Drafter, eos_ids: frozenset[int],
                 width: int = 1, children: int | None = None, spine: bool = True):
        """width: W, the nodes a level in flight keeps (1: one draft per step, a chain); children: candidates
        drafted per tip (None: W); spine: the rule `grow` keeps the W by."""
        self.executor = as_executor(stages)
        self.drafter = drafter
        self.eos_ids = eos_ids
        self.n = self.executor.n
        self.width = width
        self.children = children or width
        self.spine = spine
        if width > 1 and not (self.executor.trees and drafter.has(TREES)):
            who = type(drafter).__name__ if not drafter.has(TREES) else type(self.executor).__name__
            raise ValueError(f"W={width}: {who} runs chains only (W = 1)")
        self.capture = frozenset(drafter.layers_needed(self.executor.bounds))

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        self.stats = DecodeStats(n=self.n)
        yield from finishing(self.executor, self._decode(prompt_ids, request))
        self.stats.finish()

    def _draft(self, step, flight, features, choose, after=False) -> list[tuple[int, Proposal, float]]:
        """Every tip's candidate children: (tip, proposal, log q)."""
        tips = flight.level(step.t)
        if self.width == 1:
            return [(tips[0], self.drafter.propose(branch_view(step, flight, tips[0], features, after), choose), 0.0)]
        views = [branch_view(step, flight, tip, features, after) for tip in tips]
        drafted = propose_level(self.drafter, views, choose)       # one batched pass where the drafter can
        return [(tip, p, lp) for tip, children in zip(tips, drafted) for p, lp in children]

    def _keep(self, flight: Flight, child: int, features: dict) -> bool:
        """Keep `child`'s subtree in every stage; False if it reaches no tip of the newest level."""
        newest = max(flight.nodes[node].pos for node in flight.nodes)
        if not any(child in flight.branch(tip) for tip in flight.level(newest)):
            return False
        dropped = flight.keep(child)
        if dropped:
            self.executor.prune(flight)
            for node in dropped:
                del features[node]
        return True

    def _decode(self, prompt_ids: list[int], request: Request):
        ex, params, stats, max_new = self.executor, request.params, self.stats, request.max_new_tokens
        generator = request.generator(ex.device)
        # drafts run at most n levels (W rows each) past the last settled token before a verification can stop it
        extra = (self.n + 1) * self.width
        logits, captured = ex.prefill(prompt_ids, self.capture, context_length(len(prompt_ids), max_new, extra),
                                      params.greedy)
        self.drafter.start(captured, prompt_ids)
        first = next_token(logits, params, generator)
        verified = [*prompt_ids, first]      # what the drafter observes as positions leave the last stage
        stats.N = 1
        yield first
        done = is_final(first, stats.N, max_new, self.eos_ids)
        step = first_step(len(prompt_ids), self.n)
        flight = Flight(self.width)
        features = {flight.seed(step.t, first): {0: ex.embed(first)}}   # node -> {layer: H^l [1, 1, d]}

        if self.width == 1:
            def choose(logits):                       # a drafter's logits [V] -> the run's proposal
                return propose(logits, params, generator)
        else:
            def choose(logits):                       # -> the likeliest children, deterministic
                return propose_children(logits, self.children)

        after_step = self.drafter.has(AFTER_STEP)
        while not done:
            t = step.t
            entering = torch.cat([features[node][0] for node in flight.level(t)], 1) if step.runs(0) else None
            ex.launch(step, entering, flight=flight)
            if ex.shared:
                # the other sequences launch theirs, then spd.runtime.seed starts every stage's rows at once; the
                # draft below overlaps them where the stages run elsewhere (runtime=distributed)
                yield SHARED_STEP
            stats.ran([len(flight.level(pos)) if step.runs(s) else 0 for s, pos in enumerate(step.work)])
            if ex.shared and self.width == 1 and not after_step:
                (tip,) = flight.level(t)
                proposal = yield DraftWanted(self.drafter, branch_view(step, flight, tip, features), choose)
                options = [(tip, proposal, 0.0)]
            elif not after_step:
                options = self._draft(step, flight, features, choose)
            out = ex.collect()
            for node, captured in out.features.items():
                features[node].update(captured)
            if after_step:
                options = self._draft(step, flight, features, choose, after=True)
            stats.K += 1
            grow(flight, t + 1, options, self.spine)
            for node in flight.level(t + 1):
                features[node] = {0: ex.embed(flight.token(node))}
            if step.exiting is None:
                step = next_step(step, None)  # warm-up: nobody leaves the pipeline yet
                continue
            (root,) = flight.level(step.exiting)
            assert len(verified) == step.exiting + 1, "the exiting node is the newest settled token"
            self.drafter.observe(features.pop(root), verified)
            children = flight.children(root)
            verdict = out.exit_logits if out.exit_logits is not None else out.exit_argmax
            index, token = settle_children(verdict, [flight.nodes[c].proposal for c in children], params, generator)
            stats.settle(index is not None, flight.nodes[children[index or 0]].proposal.source)
            flight.leave(root)
            kept = index is not None and self._keep(flight, children[index], features)
            if not kept:
                # a correction, or a kept child none of whose descendants made the W best branches: the pipeline
                # refills from the settled token, alone at its position
                length = flushed_from(step)
                ex.rollback(length)
                if self.drafter.has(ROLLBACK):
                    self.drafter.rollback(length)
                features = {flight.seed(length, token): {0: ex.embed(token)}}
                stats.restarts += index is not None
            verified.append(token)
            yield token
            step = next_step(step, kept)
            done = is_final(token, stats.N, max_new, self.eos_ids)


class PipelineARDecoder(Decoder):
    """Plain pipeline-parallel AR: each token relays through the n stages, one stage busy per step (AR where this
    process holds no decoder layer, or through the same fixed-shape steps)."""

    def __init__(self, stages: StagedTarget | StageExecutor, eos_ids: frozenset[int]):
        self.executor = as_executor(stages)
        self.eos_ids = eos_ids

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        yield from finishing(self.executor, self._decode(prompt_ids, request))

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
