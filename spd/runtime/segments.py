"""FlowSpec (`method=flowspec`, ../shared/papers/002_…, §III): a draft tree kept on the controller, cut into segments
of at most S nodes that flow through the pipeline's stages one segment per step.

A round starts from the newest verified token (the tree's root, itself not yet through the target): the drafter
grows a tree from the verified context (`ChainDrafter.draft_tree`: the context's statistics or lookup, EAGLE-3's
module), its nodes in the drafter's order — parents first — cut into segments that enter stage 1 one per step, each
stage running a segment's nodes at their tree positions under their ancestor mask (`spd.tree_rows`). When a segment
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

from spd.decoding import Decoder, Request, context_length, is_final
from spd.drafters.base import ChainDrafter
from spd.metrics import DecodeStats
from spd.runtime.executor import StageExecutor
from spd.runtime.flight import Node
from spd.runtime.local import LocalStages
from spd.runtime.schedule import IDLE, segment_step
from spd.sampling import Proposal, greedy_token, next_token, settle_children, top2_margin
from spd.targets.stages import StagedTarget
from spd.tree import DraftTree


class SegmentFlight:
    """The draft tree in flight or waiting to enter, by node id, with the segment each node entered in. What
    `spd.tree_rows.StageRows` reads (`nodes`, `oldest`, `branch`) and what executors read (`level(key)`: a
    segment's nodes still alive, in entering order)."""

    def __init__(self):
        self.nodes: dict[int, Node] = {}
        self.segments: dict[int, list[int]] = {}
        self._ids = 0
        self._keys = 0

    def seed(self, pos: int, token: int) -> int:
        """A new round: the tree is `token` alone at `pos` (verified, not yet through the target)."""
        self.nodes.clear()
        self.segments.clear()
        return self._add(pos, None, Proposal(token, source="verified"))

    def _add(self, pos: int, parent: int | None, proposal: Proposal) -> int:
        node, self._ids = self._ids, self._ids + 1
        self.nodes[node] = Node(node, pos, parent, proposal, 0.0)
        return node

    def grow(self, at: int, tree: DraftTree) -> list[int]:
        """The drafter's tree rooted at node `at`'s token: its nodes whose paths the flight lacks join under `at`.
        Returns the new nodes, parents first."""
        node_of, new = {0: at}, []
        for i in range(1, len(tree)):
            parent = node_of.get(tree.parent(i))
            if parent is None:        # below a path already held: nothing new can hang there
                continue
            token = tree.proposals[i - 1].token
            held = next((c for c in self.children(parent) if self.token(c) == token), None)
            if held is None:
                held = self._add(self.nodes[parent].pos + 1, parent, tree.proposals[i - 1])
                new.append(held)
            node_of[i] = held
        return new

    def cut(self, nodes: list[int], size: int) -> list[int]:
        """Segments of at most `size` of `nodes` (in order); returns their keys."""
        keys = []
        for start in range(0, len(nodes), size):
            key, self._keys = self._keys, self._keys + 1
            self.segments[key] = nodes[start: start + size]
            keys.append(key)
        return keys

    def level(self, key: int) -> list[int]:
        return [node for node in self.segments.get(key, []) if node in self.nodes]

    @property
    def oldest(self) -> int:
        return min(node.pos for node in self.nodes.values())

    def token(self, node: int) -> int:
        return self.nodes[node].proposal.token

    def children(self, node: int) -> list[int]:
        return [c for c, n in self.nodes.items() if n.parent == node]

    def branch(self, node: int) -> list[int]:
        out = [node]
        while (parent := self.nodes[out[-1]].parent) is not None and parent in self.nodes:
            out.append(parent)
        return out[::-1]

    def leave(self, node: int) -> None:
        """A verified node whose logits were used: its rows are verified context now."""
        del self.nodes[node]

    def keep(self, child: int) -> list[int]:
        """`child` was verified: every node outside its subtree goes. Returns the dropped ids."""
        kept = {child}
        for node in sorted(self.nodes, key=lambda n: self.nodes[n].pos):
            if self.nodes[node].parent in kept:
                kept.add(node)
        dropped = [node for node in self.nodes if node not in kept]
        for node in dropped:
            del self.nodes[node]
        return dropped


class SegmentPipelineDecoder(Decoder):
    def __init__(self, stages: StagedTarget | StageExecutor, drafter: ChainDrafter, eos_ids: frozenset[int],
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
        ex = self.executor
        self.stats = DecodeStats(n=self.n)
        try:
            yield from self._decode(prompt_ids, request)
        except GeneratorExit:
            ex.finish()
            raise
        ex.finish()
        self.stats.finish()

    def _tree(self, root: int) -> DraftTree:
        # children are deterministic at every temperature (a drafter's argmax, its top-W, the context's tokens):
        # one draw of p verifies them (settle_children), however many trees added children to a node
        return self.drafter.draft_tree(root, self.depth, self.width, self.budget,
                                       lambda logits: Proposal(greedy_token(logits)))

    def _decode(self, prompt_ids: list[int], request: Request):
        ex, params, stats, max_new = self.executor, request.params, self.stats, request.max_new_tokens
        generator = request.generator(ex.device)
        # the tree may run a budget's nodes (and one segment) past the last verified token
        extra = self.budget + self.segment + 1
        logits, captured = ex.prefill(prompt_ids, self.capture, context_length(len(prompt_ids), max_new, extra),
                                      params.greedy)
        first = next_token(logits, params, generator)
        stats.N = 1
        yield first
        done = is_final(first, stats.N, max_new, self.eos_ids)
        tokens = prompt_ids + [first]
        self.drafter.start({layer: captured[layer] for layer in self.capture}, tokens)
        if self.drafter.uses_margin:
            self.drafter.target_margin(top2_margin(logits))
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
        exited: dict[int, torch.Tensor] = {}                 # node -> the target's logits after its path [V]
        step = None
        while not done:
            key = IDLE
            while queue and key == IDLE:
                key = queue.pop(0)
                if not flight.level(key):       # pruned before it entered
                    key = IDLE
            step = segment_step(step, key, self.n)
            entering = None
            if key != IDLE:
                for node in flight.level(key):
                    features.setdefault(node, {0: ex.embed(flight.token(node))})
                entering = torch.cat([features[node][0] for node in flight.level(key)], 1)
            ex.launch(step, entering, flight=flight)
            stats.ran([len(flight.level(k)) if k != IDLE else 0 for k in step.work])
            out = ex.collect()
            stats.K += 1
            for node, layers in out.features.items():
                if node in features:
                    features[node].update(layers)
            if out.exit_nodes:
                rows = out.exit_logits.view(len(out.exit_nodes), -1)
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
                    index, token = None, next_token(p, params, generator)
                    stats.N += 1
                    stats.restarts += 1
                tokens.append(token)
                own = features.pop(frontier, {})
                verified = {layer: own[layer] for layer in self.capture}
                pos = flight.nodes[frontier].pos
                flight.leave(frontier)
                self.drafter.verified(verified, tokens)
                if self.drafter.uses_margin:
                    self.drafter.target_margin(top2_margin(p))
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
