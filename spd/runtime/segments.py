"""FlowSpec (`method=flowspec`, ../shared/papers/002_…, §III): a draft tree kept on the controller, cut into segments
of at most S nodes that flow through the pipeline's stages one segment per step.

A round starts from the newest verified token (the tree's root, itself not yet through the target): the drafter
grows a tree from the verified context (a CHAIN drafter's `propose`: the context's statistics or lookup, EAGLE-3's
module), its nodes in the drafter's order — parents first — cut into segments that enter stage 1 one per step, each
stage running a segment's nodes at their tree positions under their ancestor mask (`spd.verify.tree_rows`). When a segment
leaves the last stage, its nodes' logits are known, and the walk from the deepest verified node (the frontier)
goes on while the frontier's logits are known: `settle_children` draws x ~ p once (greedy: the argmax); x a child
— it is verified, every node outside its subtree is dropped from every stage, from the segments in flight and from
those still waiting; x no child — x is emitted, everything in flight is flushed, a new round starts from x. After a
walk that verified something, the tree grows again from the new context (the paper's context-aware expansion):
the drafter's tree below the frontier, less the paths the tree already holds, joins the queue as new segments.

W = 1 chains of SPD's pipeline and its tree levels are the special case "one level per segment"; this loop is the
general one, kept separate so SPD's loop stays the paper's. Score-aware expansion (growing an unchanged tree when a
segment verified nothing) is off, as in the authors' evaluation configuration.
"""

from __future__ import annotations

import torch

from dataclasses import replace

from spd.decoding import Decoder, Request, context_length, is_final
from spd.drafters.base import MARGIN, Cycle, Drafter
from spd.metrics import DecodeStats
from spd.runtime.executor import StageExecutor
from spd.runtime.flight import SegmentFlight
from spd.runtime.local import LocalStages
from spd.runtime.pipeline import finishing
from spd.runtime.schedule import IDLE, segment_step
from spd.verify.sampling import Proposal, greedy_token, next_token, settle_children, top2_margin
from spd.targets.stages import StagedTarget
from spd.verify.tree import DraftTree


class SegmentPipelineDecoder(Decoder):
    def __init__(self, stages: StagedTarget | StageExecutor, drafter: Drafter, eos_ids: frozenset[int],
                 segment: int, depth: int, width: int = 1, budget: int | None = None):
        """segment: S, nodes per segment; depth, width, budget: each tree the drafter grows (D, its children per
        node, N nodes besides the root)."""
        self.executor = LocalStages(stages) if isinstance(stages, StagedTarget) else stages
        if not getattr(self.executor, "segments", False):
            raise ValueError(f"{type(self.executor).__name__} runs no segments")
        if segment < 1 or depth < 1:
            raise ValueError(f"segment={segment} and depth={depth} must be >= 1")
        self.drafter, self.eos_ids = drafter, eos_ids
        self.n = self.executor.n
        self.segment, self.depth, self.width, self.budget = segment, depth, width, budget or depth
        self.capture = frozenset(drafter.layers_needed())

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        self.stats = DecodeStats(n=self.n)
        yield from finishing(self.executor, self._decode(prompt_ids, request))
        self.stats.finish()

    def _tree(self, root: int) -> DraftTree:
        # children are deterministic at every temperature (a drafter's argmax, its top-W, the context's tokens):
        # one draw of p verifies them (settle_children), however many trees added children to a node
        return self.drafter.propose(Cycle(root, self.depth, self.width, self.budget, self.margin),
                                    lambda logits: Proposal(greedy_token(logits)))

    def _decode(self, prompt_ids: list[int], request: Request):
        ex, params, stats, max_new = self.executor, request.params, self.stats, request.max_new_tokens
        generator = request.generator(ex.device)
        # the tree may run a budget's nodes (and one segment) past the last verified token
        extra = self.budget + self.segment + 1
        # greedy, the stages may send each exiting node's argmax alone, unless the drafter prices with the margin
        logits, captured = ex.prefill(prompt_ids, self.capture, context_length(len(prompt_ids), max_new, extra),
                                      params.greedy and not self.drafter.has(MARGIN))
        first = next_token(logits, params, generator)
        stats.N = 1
        yield first
        done = is_final(first, stats.N, max_new, self.eos_ids)
        tokens = prompt_ids + [first]
        self.drafter.start({layer: captured[layer] for layer in self.capture}, tokens)
        # the target's margin at the newest verified token, for a drafter that prices with it
        self.margin = top2_margin(logits) if self.drafter.has(MARGIN) else None
        flight = SegmentFlight()
        queue: list[int] = []
        features: dict[int, dict[int, torch.Tensor]] = {}   # node -> {layer: H^l [1, 1, d]}

        def new_round(pos: int, token: int) -> int:
            root = flight.seed(pos, token)
            features.clear()
            nodes = [root, *flight.grow(root, self._tree(token))]
            queue[:] = flight.cut(nodes, self.segment)
            return root

        frontier = new_round(len(prompt_ids), first)
        exited: dict[int, torch.Tensor | int] = {}           # node -> the target's logits after its path [V] (or argmax)
        step = None
        while not done:
            key = IDLE
            while queue and key == IDLE:
                key = queue.pop(0)
                if not flight.level(key):       # pruned before it entered
                    key = IDLE
            step = segment_step(step, key, self.n)
            # a segment pruned to nothing in flight idles its stage (PipeDec's rule for empty groups too)
            step = replace(step, work=tuple(k if k == IDLE or flight.level(k) else IDLE for k in step.work))
            entering = None
            if key != IDLE:
                for node in flight.enter(key):
                    features.setdefault(node, {0: ex.embed(flight.token(node))})
                entering = torch.cat([features[node][0] for node in flight.level(key)], 1)
            ex.launch(step, entering, flight=flight)
            flight.heard()
            stats.ran([len(flight.level(k)) if k != IDLE else 0 for k in step.work])
            out = ex.collect()
            stats.K += 1
            for node, layers in out.features.items():
                if node in features:
                    features[node].update(layers)
            if out.exit_nodes:       # each one's logits [V], or (greedy, between processes) its argmax
                rows = out.exit_logits.view(len(out.exit_nodes), -1) if out.exit_logits is not None else \
                    out.exit_argmax if isinstance(out.exit_argmax, list) else [out.exit_argmax]
                exited.update({node: rows[i] for i, node in enumerate(out.exit_nodes) if node in flight.nodes})
            grew = False
            while frontier in exited and not done:
                children = flight.children(frontier)
                p = exited.pop(frontier)
                if children:
                    index, token = settle_children(p, [flight.nodes[c].proposal for c in children], params,
                                                   generator)
                    stats.settle(index is not None, flight.nodes[children[index or 0]].proposal.source)
                else:                           # the round reached a leaf: the target's next token comes free
                    index, token = None, p if isinstance(p, int) else next_token(p, params, generator)
                    stats.N += 1
                    stats.restarts += 1
                tokens.append(token)
                own = features.pop(frontier, {})
                verified = {layer: own[layer] for layer in self.capture}
                pos = flight.nodes[frontier].pos
                flight.leave(frontier)
                self.drafter.observe(verified, tokens)
                if self.drafter.has(MARGIN):
                    self.margin = top2_margin(p)
                yield token
                done = is_final(token, stats.N, max_new, self.eos_ids)
                if index is None:
                    # a correction (or a leaf): everything in flight is flushed, a new round starts from the token
                    ex.rollback(pos + 1)
                    exited.clear()
                    step = None
                    if not done:
                        frontier = new_round(pos + 1, token)
                    break
                frontier = children[index]
                for node in flight.keep(frontier):
                    features.pop(node, None)
                    exited.pop(node, None)
                ex.prune(flight)
                grew = True
            if grew and not done:
                # context-aware expansion: the tree below the new frontier, less what the flight holds
                queue += flight.cut(flight.grow(frontier, self._tree(flight.token(frontier))),
                                    self.segment)
