"""What is in flight in SPD's pipeline when each step drafts a tree level (W >= 1, design §8), tensor-free.

The schedule (`spd.runtime.schedule`) still says which *position* each stage advances; with trees a position is a
tree level holding up to W nodes, every one at that RoPE position. The oldest level in flight is always one node:
the token that leaves the last stage next, already verified (its parent's exit accepted it, or it is the first or
corrected token that refilled the pipeline). When it leaves, the target's token at it picks which of its children
survives: every stage keeps only that child's subtree (`Flight.keep`), or everything newer is flushed.

Node ids are position * W + index within the level when it entered, so for W = 1 a node's id *is* its position
and a chain in flight is keyed exactly as before trees existed.

`SegmentFlight` is FlowSpec's (spd.runtime.segments): a tree whose nodes enter in segments of several positions.
Each stage's KV cache rows over either are kept by `spd.verify.tree_rows.StageRows`; the stage processes restore either
from its `structure()` as a SegmentFlight (a level is the segment keyed by its position).
"""

from __future__ import annotations

from dataclasses import dataclass

from spd.verify.sampling import Proposal


@dataclass(frozen=True)
class Node:
    id: int
    pos: int
    parent: int | None       # None: nothing older is in flight on its branch
    proposal: Proposal       # its token, the q it was drawn from (None: deterministic) and its source
    score: float             # cumulative log q of its branch: what the W kept branches are ranked by


def branch(nodes: dict[int, Node], node: int) -> list[int]:
    """The node and its ancestors still in flight, oldest first."""
    out = [node]
    while (parent := nodes[out[-1]].parent) is not None and parent in nodes:
        out.append(parent)
    return out[::-1]


class Flight:
    def __init__(self, width: int = 1):
        if width < 1:
            raise ValueError(f"W={width} must be >= 1")
        self.width = width
        self.nodes: dict[int, Node] = {}
        self._levels: dict[int, list[int]] = {}
        self.spine: int | None = None     # the newest node of the branch that always grows (spd.runtime.pipeline.grow)
        self.left = None                  # every node gone below the oldest level was verified (spd.verify.tree_rows)

    @classmethod
    def restore(cls, width: int, nodes: list[tuple[int, int, int | None]]) -> "Flight":
        """The structure of a flight another process holds, from (id, pos, parent) in level order (no tokens: a
        stage process masks and prunes by structure alone)."""
        flight = cls(width)
        for node, pos, parent in nodes:
            flight.nodes[node] = Node(node, pos, parent, Proposal(-1), 0.0)
            flight._levels.setdefault(pos, []).append(node)
        return flight

    @property
    def levels(self) -> list[int]:
        return list(self._levels)

    def seed(self, pos: int, token: int) -> int:
        """Empty the pipeline; `token` (the first generated or a correction) enters alone at `pos`."""
        self.nodes.clear()
        self._levels.clear()
        self.spine = self.enter(pos, None, Proposal(token, source="verified"))
        return self.spine

    def enter(self, pos: int, parent: int | None, proposal: Proposal, score: float = 0.0) -> int:
        level = self._levels.setdefault(pos, [])
        if len(level) == self.width:
            raise ValueError(f"level {pos} already holds W={self.width} nodes")
        if parent is not None and self.nodes[parent].pos != pos - 1:
            raise ValueError(f"node {parent} at {self.nodes[parent].pos} cannot parent a node at {pos}")
        node = Node(pos * self.width + len(level), pos, parent, proposal, score)
        self.nodes[node.id] = node
        level.append(node.id)
        return node.id

    def level(self, pos: int) -> list[int]:
        return self._levels.get(pos, [])

    @property
    def oldest(self) -> int:
        return min(self._levels)

    def token(self, node: int) -> int:
        return self.nodes[node].proposal.token

    def children(self, node: int) -> list[int]:
        return [c for c in self.level(self.nodes[node].pos + 1) if self.nodes[c].parent == node]

    def branch(self, node: int) -> list[int]:
        return branch(self.nodes, node)

    def leave(self, node: int) -> None:
        """The oldest node left the last stage (its children were just verified against it)."""
        if self.level(self.oldest) != [node]:
            raise ValueError(f"node {node} is not the one oldest node in flight")
        del self._levels[self.nodes.pop(node).pos]

    def keep(self, child: int) -> list[int]:
        """`child` was accepted: drop its siblings and everything below them. Returns the dropped ids."""
        kept = {child}
        dropped = []
        for pos in sorted(p for p in self._levels if p >= self.nodes[child].pos):
            level = []
            for node in self._levels[pos]:
                if node in kept or self.nodes[node].parent in kept:
                    kept.add(node)
                    level.append(node)
                else:
                    dropped.append(node)
                    del self.nodes[node]
            self._levels[pos] = level
        if self.spine not in self.nodes:       # the spine was a dropped sibling's: the likeliest kept tip takes over
            newest = self.level(max(self._levels))
            self.spine = max(newest, key=lambda node: self.nodes[node].score) if newest else None
        return dropped

    def is_chain(self) -> bool:
        return all(len(level) == 1 for level in self._levels.values())

    def structure(self) -> list[tuple[int, int, int | None, int]]:
        """(id, pos, parent, level) of every node in flight, level by level: what the stage processes restore
        (`SegmentFlight.restore`), a level's group being its position."""
        return [(node, pos, self.nodes[node].parent, pos) for pos in sorted(self._levels) for node in self._levels[pos]]


LEFT = -2     # a structure row's group for a verified node that left (SegmentFlight.structure)


class SegmentFlight:
    """The draft tree in flight or waiting to enter, by node id, with the segment each node entered in. What
    `spd.verify.tree_rows.StageRows` reads (`nodes`, `oldest`, `branch`) and what executors read (`level(key)`: a
    segment's nodes still alive, in entering order)."""

    def __init__(self):
        self.nodes: dict[int, Node] = {}
        self.segments: dict[int, list[int]] = {}
        self.segment_of: dict[int, int] = {}
        self.entered: set[int] = set()       # nodes whose segment entered stage 1
        self.left: set[int] = set()          # verified nodes gone since the stages last heard (spd.verify.tree_rows)
        self._ids = 0
        self._keys = 0

    @classmethod
    def restore(cls, rows: list[tuple[int, int, int | None, int]]) -> "SegmentFlight":
        """The structure another process holds, from `structure()`'s (id, pos, parent, group) rows (no tokens: a
        stage process masks and prunes by structure alone). Serves SPD's levels too: their group is the position."""
        flight = cls()
        for node, pos, parent, group in rows:
            if group == LEFT:
                flight.left.add(node)
                continue
            flight.nodes[node] = Node(node, pos, parent, Proposal(-1), 0.0)
            flight.segments.setdefault(group, []).append(node)
            flight.segment_of[node] = group
            flight.entered.add(node)
        # no verified node left since the last message (SPD's levels always): every row gone below the oldest is one
        flight.left = flight.left or None
        return flight

    def structure(self) -> list[tuple[int, int, int | None, int]]:
        """(id, pos, parent, segment) of every node alive that entered the pipeline, in entering order, then the
        verified nodes that left since `heard` (their group LEFT): what the stage processes need to mask and prune
        (the nodes still waiting are the controller's business)."""
        alive = [(node, self.nodes[node].pos, self.nodes[node].parent, self.segment_of[node])
                 for node in sorted(self.entered) if node in self.nodes]
        return alive + [(node, -1, None, LEFT) for node in sorted(self.left)]

    def heard(self) -> None:
        """The stages were sent `structure()`: the verified nodes that left are pruned by then."""
        self.left.clear()

    def seed(self, pos: int, token: int) -> int:
        """A new round: the tree is `token` alone at `pos` (verified, not yet through the target)."""
        self.nodes.clear()
        self.segments.clear()
        self.segment_of.clear()
        self.entered.clear()       # `left` stays until the stages hear it: they prune with it before a flush's crop
        return self._add(pos, None, Proposal(token, source="verified"))

    def _add(self, pos: int, parent: int | None, proposal: Proposal) -> int:
        node, self._ids = self._ids, self._ids + 1
        self.nodes[node] = Node(node, pos, parent, proposal, 0.0)
        return node

    def grow(self, at: int, tree) -> list[int]:
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
            self.segment_of.update((node, key) for node in self.segments[key])
            keys.append(key)
        return keys

    def enter(self, key: int) -> list[int]:
        """Segment `key` enters stage 1 this step: its nodes still alive."""
        nodes = self.level(key)
        self.entered.update(nodes)
        return nodes

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
        return branch(self.nodes, node)

    def leave(self, node: int) -> None:
        """A verified node whose logits were used: its rows are verified context now."""
        del self.nodes[node]
        self.entered.discard(node)
        self.left.add(node)

    def keep(self, child: int) -> list[int]:
        """`child` was verified: every node outside its subtree goes. Returns the dropped ids."""
        kept = {child}
        for node in sorted(self.nodes, key=lambda n: self.nodes[n].pos):
            if self.nodes[node].parent in kept:
                kept.add(node)
        dropped = [node for node in self.nodes if node not in kept]
        for node in dropped:
            del self.nodes[node]
            self.entered.discard(node)
        return dropped
