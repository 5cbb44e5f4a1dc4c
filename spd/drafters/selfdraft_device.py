"""Self-Draft's draft branches as fixed-shape rows of the device step (spd.runtime.device_step): N branches of L
rows each ride after the tree's rows in every step, always N × L rows, so the step keeps one shape whatever the
branches hold. A branch fills from one token to L (rows past its length are computed and ignored: no real row sees
them), and the step updates every branch as tensor ops: append its last filled row's prediction, drop the first
token once past L (spd.drafters.selfdraft's rule). The n-gram caches stay on the host (LRU dictionaries): the step
writes the rows' predictions into the buffer it returns, and the host's DraftBranches applies the same update to
its own copy of the branches, so the two stay equal (tests/test_device_selfdraft.py checks it)."""

from __future__ import annotations

import torch


class DeviceBranches:
    """The branches' tokens [N, L] (a view of the step state's rows after the tree's, bound by `bind`) and how many
    of each branch's rows hold tokens (`filled` []: every branch grows together)."""

    def __init__(self, branches: int, branch_length: int, device: torch.device):
        self.n, self.length = branches, branch_length
        self.rows = branches * branch_length
        self.filled = torch.ones((), dtype=torch.long, device=device)                 # []
        self.columns = torch.arange(branch_length, device=device).view(1, -1)          # [1, L]
        self.tokens: torch.Tensor | None = None                                       # [N, L]

    def offsets(self) -> torch.Tensor:
        """Each row's position minus the root's [N·L]: row j of a branch right after the context, at + 1 + j."""
        return (self.columns[0] + 1).repeat(self.n)

    def visible(self) -> torch.Tensor:
        """[N·L, N·L]: a row sees its own branch's rows up to itself (block-diagonal causal; the root too, which the
        step adds)."""
        causal = torch.ones(self.length, self.length, dtype=torch.bool, device=self.filled.device).tril()
        return torch.block_diag(*[causal] * self.n)

    def bind(self, rows: torch.Tensor) -> None:
        """rows [N·L]: the step state's token rows the branches live in."""
        self.tokens = rows.view(self.n, self.length)

    def start(self, branches: list[list[int]]) -> None:
        """The host's fresh branches (each as long as the others) copied in."""
        host = torch.zeros(self.n, self.length, dtype=torch.long)
        for i, branch in enumerate(branches):
            host[i, : len(branch)] = torch.tensor(branch)
        self.tokens.copy_(host, non_blocking=True)
        self.filled.fill_(len(branches[0]) if branches else 1)

    def advance(self, predicted: torch.Tensor) -> None:
        """predicted [N·L]: the target's argmax after each row. Each branch gains its last filled row's prediction
        (at column `filled`, or after a shift left once the branch holds L)."""
        n, length = self.n, self.length
        last = predicted.view(n, length).gather(1, (self.filled - 1).view(1, 1).expand(n, 1))    # [N, 1]
        grown = torch.cat([self.tokens, torch.zeros_like(last)], 1)                           # [N, L + 1]
        grown.scatter_(1, self.filled.view(1, 1).expand(n, 1), last)
        shift = (self.filled == length).long()                                                  # []
        self.tokens.copy_(grown.gather(1, (self.columns + shift).expand(n, length)))
        self.filled.copy_((self.filled + 1).clamp(max=length))

    def mutable(self) -> list[torch.Tensor]:
        return [self.filled]
