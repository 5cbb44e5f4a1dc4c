"""One KV cache's rows over a draft tree that flows and is pruned (a pipeline stage's, or a draft model's).

`StageRows` keeps `base` rows that every query sees (the prompt and verified tokens, at positions 0..base-1), then
tree rows in the order they were run, each visible only to its own descendants. It reads the tree through three
things only — `nodes` (the nodes still alive, by id, each with its `pos`), `oldest` (the oldest position alive) and `branch(node)` (a node and
its alive ancestors) — which `spd.runtime.flight.Flight` has, and so does a drafter's own picture of the tree built
from its step views, so the runtime's stages and PipeDec's draft model compact their caches by one rule. Executors
read it to build masks and to compact caches after a prune. Tensor-free.
"""

from __future__ import annotations

from typing import Collection, Mapping, Protocol


class Node(Protocol):
    pos: int


class Tree(Protocol):
    nodes: Mapping[int, Node]
    oldest: int
    # the verified nodes that left since the last prune (FlowSpec: a walk may verify several levels between two
    # prunes, so a dropped sibling can sit below the oldest alive node); None: every node gone below the oldest
    # level is verified (a level per step, SPD)
    left: Collection[int] | None

    def branch(self, node: int) -> list[int]: ...


class StageRows:
    """One stage's cache rows: `base` verified rows, then (node, pos) tree rows in the order they were run."""

    def __init__(self, base: int):
        self.base = base
        self.rows: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return self.base + len(self.rows)

    def append(self, nodes: list[int], pos: int | list[int]) -> None:
        """Rows of `nodes` were run, in this order: at one position (a tree level) or at one each (a segment)."""
        self.rows += list(zip(nodes, [pos] * len(nodes) if isinstance(pos, int) else pos))

    def fold(self, flight: Tree) -> None:
        """Rows that left the flight older than its oldest level are verified: they join the base."""
        oldest = flight.oldest
        while self.rows and self.rows[0][0] not in flight.nodes and self.rows[0][1] < oldest:
            assert self.rows[0][1] == self.base, "verified rows must sit at their positions"
            self.base += 1
            self.rows.pop(0)

    def prune(self, flight: Tree) -> tuple[int, list[int]] | None:
        """Drop the rows of nodes the flight dropped. Returns (start, slots) for the cache's `keep` (the kept tree
        rows' slots, moved down to start), or None when nothing moved."""
        oldest, left = flight.oldest, flight.left
        kept = [i for i, (node, pos) in enumerate(self.rows)
                if node in flight.nodes or (pos < oldest and (left is None or node in left))]
        start = self.base
        moved = None if len(kept) == len(self.rows) else (start, [start + i for i in kept])
        self.rows = [self.rows[i] for i in kept]
        self.fold(flight)
        return moved

    def crop(self, length: int) -> None:
        """A rejection: every position >= length is forgotten; what stays is verified, at its positions."""
        self.base += sum(pos < length for _, pos in self.rows)
        self.rows = []
        assert self.base == length, (self.base, length)

    def sees_all(self, queries: list[int], flight: Tree) -> bool:
        """Whether every cached row is visible to every query (a chain: the plain causal path applies)."""
        if len(queries) != 1:
            return False
        branch = set(flight.branch(queries[0]))
        oldest = flight.oldest
        return all(node in branch or pos < oldest for node, pos in self.rows)

    def visible(self, queries: list[int], flight: Tree) -> tuple[list[list[bool]], list[int]]:
        """Which cached rows (then the queries' own new rows) each query sees, and every key's position. The queries
        are a tree level (none sees another) or a segment (ancestors first: each sees those on its branch)."""
        oldest = flight.oldest
        rows = []
        for q in queries:
            branch = set(flight.branch(q))
            rows.append([True] * self.base + [node in branch or pos < oldest for node, pos in self.rows]
                        + [other in branch for other in queries])
        return rows, list(range(self.base)) + [p for _, p in self.rows] + [flight.nodes[q].pos for q in queries]
