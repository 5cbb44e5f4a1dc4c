"""What is in flight in SPD's pipeline when each step drafts a tree level (W >= 1, design §8), tensor-free.

The schedule (`spd.runtime.schedule`) still says which *position* each stage advances; with trees a position is a
tree level holding up to W nodes, every one at that RoPE position. The oldest level in flight is always one node:
the token that leaves the last stage next, already verified (its parent's exit accepted it, or it is the first or
corrected token that refilled the pipeline). When it leaves, the target's token at it picks which of its children
survives: every stage keeps only that child's subtree (`Flight.keep`), or everything newer is flushed.

Node ids are position * W + index within the level when it entered, so for W = 1 a node's id *is* its position
and a chain in flight is keyed exactly as before trees existed.

Each stage's KV cache rows over the flight are kept by `spd.tree_rows.StageRows`.
"""

from __future__ import annotations

from dataclasses import dataclass

from spd.sampling import Proposal


@dataclass(frozen=True)
class Node:
    id: int
    pos: int
    parent: int | None       # None: nothing older is in flight on its branch
    proposal: Proposal       # its token, the q it was drawn from (None: deterministic) and its source
    score: float             # cumulative log q of its branch: what the W kept branches are ranked by


class Flight:
    def __init__(self, width: int = 1):
        if width < 1:
            raise ValueError(f"W={width} must be >= 1")
        self.width = width
        self.nodes: dict[int, Node] = {}
        self._levels: dict[int, list[int]] = {}
        self.spine: int | None = None     # the newest node of the branch that always grows (spd.runtime.pipeline.grow)

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
        """The node and its ancestors still in flight, oldest first."""
        out = [node]
        while (parent := self.nodes[out[-1]].parent) is not None and parent in self.nodes:
            out.append(parent)
        return out[::-1]

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
