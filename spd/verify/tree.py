"""Draft trees (W > 1, design §8): nodes with parent pointers, in the order they are fed to the target.

Node 0 is the root: the newest verified token, fed with its drafts and not itself verified. Every other node is a
drafted token whose parent comes before it (parents first, so one pass settles the tree). A node sits at RoPE
position prefix + depth whatever its index, and sees the verified prefix and its own ancestors only — the ancestor
closure is built from parent pointers, never from sort order (ties in a sort broke it for others). A chain (W = 1)
is the tree whose every parent is the node before it: its mask is causal and its positions contiguous.

Tensor-free but for `visibility`, which turns the pointers into the boolean [T, T] block the target's mask embeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spd.verify.sampling import Proposal


@dataclass
class DraftTree:
    root: int                                                   # the newest verified token
    proposals: list[Proposal] = field(default_factory=list)     # node i + 1's token, q and source
    parents: list[int] = field(default_factory=list)            # node i + 1's parent (a node index < i + 1)

    @classmethod
    def chain(cls, root: int, proposals: list[Proposal]) -> "DraftTree":
        return cls(root, list(proposals), list(range(len(proposals))))

    def add(self, parent: int, proposal: Proposal) -> int:
        if not 0 <= parent <= len(self.proposals):
            raise ValueError(f"parent {parent} is not a node of a tree of {len(self)} nodes")
        self.proposals.append(proposal)
        self.parents.append(parent)
        return len(self.proposals)

    def __len__(self) -> int:
        """Nodes, the root included: the rows the target runs."""
        return 1 + len(self.proposals)

    def token(self, node: int) -> int:
        return self.root if node == 0 else self.proposals[node - 1].token

    def parent(self, node: int) -> int:
        return self.parents[node - 1]

    def tokens(self) -> list[int]:
        return [self.root, *(p.token for p in self.proposals)]

    def depths(self) -> list[int]:
        out = [0]
        for parent in self.parents:
            out.append(out[parent] + 1)
        return out

    def children(self, node: int) -> list[int]:
        return [i + 1 for i, parent in enumerate(self.parents) if parent == node]

    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.proposals)))

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        out = [node]
        while out[-1]:
            out.append(self.parent(out[-1]))
        return out[::-1]

    def visibility(self, device=None) -> torch.Tensor:
        """[T, T] bool: row i may attend to node j iff j is i or an ancestor of i."""
        t = len(self)
        visible = torch.zeros(t, t, dtype=torch.bool)
        visible[0, 0] = True
        for i, parent in enumerate(self.parents, start=1):
            visible[i] = visible[parent]
            visible[i, i] = True
        return visible.to(device)
