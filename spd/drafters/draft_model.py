"""PipeDec's drafter (`method=pipedec`, ../shared/papers/000_…, §3.3): a separate draft model, run as the pipeline's
first stage, grows the tree in flight one layer per step.

Each step the draft model runs the newest level's nodes (the tips) over its own KV cache — the verified context,
then one row per tree node still alive, each seeing only its ancestors (the paper's "past" and "predict" caches in
one, compacted by `spd.verify.tree_rows.StageRows`, the rule the target's stages prune by) — and hands every tip's `c`
likeliest children with their log q to the pipeline (`spd.runtime.pipeline.grow` keeps the `w` best by cumulative
log q). It knows the tree only through its step views: the nodes on some tip's branch are alive, the oldest is
verified; a node that fell off every branch (a rejected sibling, a branch that lost the cut) loses its row at the
next step, before any query could see it, and a rollback crops the cache at the verified length.

The draft model (`DraftLM`) is the target's first k decoder layers, its final norm and head (an early exit: the
smallest model the suite can load for any target without training; `draft_layers=k`). It reads tokens only.
"""

from __future__ import annotations

import torch

from spd.drafters.base import BATCHED, PIPELINED, ROLLBACK, TREES, Drafter, StepView
from spd.verify.sampling import Proposal
from spd.targets.stages import StagedTarget
from spd.verify.tree_rows import StageRows


class DraftLM:
    """A causal LM over tokens: `layers` decoder layers of `staged`'s model, then its final norm and head."""

    def __init__(self, staged: StagedTarget, layers: int):
        if not 1 <= layers <= staged.num_layers:
            raise ValueError(f"draft_layers={layers} outside 1..{staged.num_layers}")
        self.staged = staged
        self.layers = layers

    def new_cache(self):
        return self.staged.new_cache()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, visible=None) -> torch.Tensor:
        """ids [1, T] at positions [T] (under `visible`: ([T, S] bool, key positions [S]) for tree rows) -> logits
        [T, V]; their K/V join the cache."""
        hidden, _ = self.staged.run_layers(self.staged.embed(ids), positions, 0, self.layers, cache, visible=visible)
        return self.staged.logits(hidden[0])


class _Branches:
    """The tree in flight as the step's views show it (what `StageRows` reads): a node is alive when it lies on
    some tip's branch; each branch is its view's in-flight tokens, oldest first. A level exits a step, so every
    node gone below the oldest one was verified (`left` None)."""

    left = None

    def __init__(self, views: list[StepView]):
        self._branch = {}
        self.nodes = {}                            # node -> its InFlight (its token and position)
        for view in views:
            nodes = [item.node for item in view.in_flight]
            for i, item in enumerate(view.in_flight):
                self._branch[item.node] = nodes[: i + 1]
                self.nodes[item.node] = item
        self.oldest = views[0].in_flight[0].pos

    def branch(self, node: int) -> list[int]:
        return self._branch[node]


class DraftModelDrafter(Drafter):
    capabilities = frozenset({PIPELINED, TREES, BATCHED, ROLLBACK})     # reads tokens only: no target layers

    def __init__(self, model: DraftLM):
        self.model = model

    def start(self, prompt_hidden, prompt_ids: list[int]) -> None:
        self.cache = self.model.new_cache()
        device = self.model.staged.device
        self.model(torch.tensor([prompt_ids], device=device), torch.arange(len(prompt_ids), device=device),
                   self.cache)
        self.rows = StageRows(len(prompt_ids))

    def propose(self, view: StepView, propose) -> Proposal:
        return self.propose_branches([view], propose)[0]

    def propose_branches(self, views: list[StepView], propose) -> list:
        tree = _Branches(views)
        moved = self.rows.prune(tree)
        if moved is not None:
            self.cache.keep(*moved, layers=range(self.model.layers))
        tips = [view.in_flight[-1] for view in views]
        nodes, pos = [tip.node for tip in tips], tips[0].pos
        device = self.model.staged.device
        ids = torch.tensor([[tip.token for tip in tips]], device=device)
        positions = torch.full((len(tips),), pos, device=device)
        if self.rows.sees_all(nodes, tree):
            logits = self.model(ids, positions, self.cache)
        else:
            visible, keys = self.rows.visible(nodes, tree)
            logits = self.model(ids, positions, self.cache, (torch.tensor(visible, device=device),
                                                             torch.tensor(keys, device=device)))
        self.rows.append(nodes, pos)
        return [_labelled(propose(row)) for row in logits]

    def observe(self, hidden, tokens) -> None:
        """Verified rows join the base at the next step's prune."""

    def rollback(self, length: int) -> None:
        self.rows.crop(length)
        self.cache.crop(length)


SOURCE = "draft_model"


def _labelled(proposed):
    """propose's result (a Proposal, or a tip's children with their log q) with the draft model as its source."""
    if isinstance(proposed, Proposal):
        return proposed._replace(source=SOURCE)
    return [(proposal._replace(source=SOURCE), log_q) for proposal, log_q in proposed]


def pipelined_drafter(*, draft_model: DraftLM) -> DraftModelDrafter:
    """PipeDec's drafter (spd.methods): the session's draft model."""
    return DraftModelDrafter(draft_model)
