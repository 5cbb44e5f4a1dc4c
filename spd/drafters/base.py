"""The interfaces drafters implement. `Drafter`: a pipelined drafter (spd.runtime.pipeline) — the decoding loop
owns the target, its caches and the in-flight tokens; a drafter says which target layers it reads and whether it
drafts during the step (SPD) or after it (PPSD, the output-state ablation), sees the prompt's hidden states once, a
read-only view of each step (from which it proposes the next position's token), each position as it leaves the
last stage, and every rollback. `ChainDrafter`: a
draft-then-verify drafter (spd.runtime.chain: EAGLE-3, the context lookup) — up to m proposals per cycle, then
the verified sequence and the target's states for it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping

import torch

from spd.verify.sampling import Proposal
from spd.verify.tree import DraftTree


@dataclass(frozen=True)
class InFlight:
    """One token inside the pipeline when a step begins."""

    token: int
    pos: int
    depth: int                          # stages passed so far (0 = about to enter stage 1)
    features: Mapping[int, torch.Tensor]  # {layer l: H^l [1, 1, d]} for every captured layer l <= b_depth
    node: int = -1                      # its node in the flight (spd.runtime.flight; a chain's: its position)


@dataclass(frozen=True)
class StepView:
    """What a drafter may read of a step (it must not change any of it): at its start, or after it for a drafter
    that runs after the step (then every token is one stage deeper and the oldest may just have left the last one)."""

    t: int                               # position of the newest token (the one that entered stage 1)
    occupancy: int                       # tokens in flight when the step began, the newest included
    n: int
    in_flight: tuple[InFlight, ...]      # oldest first; in_flight[-1].pos == t (depth 0 before the step, 1 after)


class Drafter(ABC):
    after_step = False   # True: draft reads the step's outputs, so it runs after the step, not beside it
    branches = False     # True: `draft` returns whatever propose returns, so a tree step may ask for W children
    @abstractmethod
    def layers_needed(self, bounds: list[int]) -> list[int]:
        """Target layers l whose H^l this drafter reads (0 = the embedding), for a pipeline with these bounds."""

    @abstractmethod
    def start(self, prompt_hidden: dict[int, torch.Tensor], prompt_ids: list[int]) -> None:
        """prompt_hidden: {layer: H^layer [1, P, d]} for the layers the drafter asked for."""

    @abstractmethod
    def draft(self, view: StepView, propose) -> Proposal:
        """The proposal for position view.t + 1, made while the step's stages run. propose(logits [V_target]) ->
        Proposal is the run's choice from a drafter's logits (argmax, or a sample with its q); a drafter without
        logits returns Proposal(token, source=...) (deterministic, q = None). A drafter that `branches` returns
        propose's result as it is: in a tree step (W > 1) that is the W best children with their log q."""

    def draft_branches(self, views: list[StepView], propose) -> list:
        """`draft` for every tip of a tree level (one view per branch, W > 1); a drafter that can batches them."""
        return [self.draft(view, propose) for view in views]

    @classmethod
    def draft_together(cls, drafters: list["Drafter"], views: list[StepView], proposes: list) -> list[Proposal]:
        """`draft` of several sequences' drafters of this class, each on its own view with its own propose (SEED's
        schedule: every sequence sharing a pipeline step drafts at once); a class that can batches them."""
        return [drafter.draft(view, propose) for drafter, view, propose in zip(drafters, views, proposes)]

    @abstractmethod
    def finalize(self, pos: int, hidden: dict[int, torch.Tensor]) -> None:
        """Position `pos` left the last stage (it is verified): its hidden states are final."""

    def on_rollback(self, length: int) -> None:
        """Every position >= length was discarded (a rejection); only positions < length remain."""


class WrappedDrafter(Drafter):
    """Forwards every call to `inner`; a subclass overrides what it changes (the drafts it returns, timing, ...)."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.after_step = inner.after_step
        self.branches = inner.branches

    def layers_needed(self, bounds):
        return self.inner.layers_needed(bounds)

    def start(self, prompt_hidden, prompt_ids):
        self.inner.start(prompt_hidden, prompt_ids)

    def draft(self, view, propose):
        return self.inner.draft(view, propose)

    def finalize(self, pos, hidden):
        self.inner.finalize(pos, hidden)

    def on_rollback(self, length):
        self.inner.on_rollback(length)


class ChainDrafter(ABC):
    """One method drafts: `draft_tree`, a chain being the tree of width 1."""

    branches = False     # True: draft_tree grows trees wider than one branch (W > 1)
    uses_margin = False  # True: it prices with the target's margin, so the runtime computes it (`target_margin`)
    extra_rows = 0       # rows beyond the cycle's budget it may feed a forward (a wider tree, `side_rows`): the
                         # static cache is sized for them

    @abstractmethod
    def layers_needed(self, bounds: list[int] | None = None) -> list[int]:
        """Target layers l whose H^l this drafter reads (bounds: unused; the chain runs no pipeline)."""

    @abstractmethod
    def start(self, prompt_hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """prompt_hidden: {layer: H^layer [1, P, d]}; tokens: the prompt and the first generated token (P + 1)."""

    @abstractmethod
    def draft_tree(self, root: int, m: int, width: int, budget: int, propose) -> DraftTree:
        """The drafts below `root` (the newest verified token) as a tree, parents first: depth <= m, at most
        `width` children per node, at most `budget` nodes besides the root; W = 1 is a chain (`DraftTree.chain`),
        and a tree of the root alone makes the cycle a plain AR step. propose(logits [V_target]) -> Proposal turns a
        drafter's logits into the run's choice (argmax, or a sample with its q); a drafter without logits proposes
        Proposal(token) (deterministic, q = None)."""

    def target_margin(self, margin: float) -> None:
        """The target's top-2 logit margin where it chose the newest verified token (its confidence there), given
        before each `draft_tree`; a drafter that prices its candidates may use it."""

    def sampling_draws(self, draws) -> None:
        """The request's keyed draws (spd.verify.sampling.KeyedDraws; None when greedy), given after `start`: the noise
        that will choose the token at each position, so a drafter that prices its candidates may weigh each by its
        own noise. Reading it changes no output."""

    def side_rows(self):
        """Rows to run beside this cycle's tree in its verification forward, after the tree's nodes (Self-Draft's
        draft branches, spd.drafters.selfdraft): None, or (tokens [R], offsets [R] (each row's position minus the
        root's), visible [R, R] bool: which of these rows each row sees). Every side row also sees the verified
        cache and the root (node 0, the newest verified token), never another tree node; no tree node sees a side
        row. Their K/V never stay in the cache (the settle keeps only the accepted path's rows). Asked after
        `draft_tree`; default none."""
        return None

    def side_logits(self, logits: torch.Tensor) -> None:
        """The target's logits [R, V] of the rows `side_rows` gave, handed back before the cycle settles (called
        only when those rows ran: a decoder that runs no side rows, the batched one, never calls it)."""

    def device_side(self, device: torch.device):
        """The side rows as fixed rows of the device step (spd.runtime.device_step's StepState `side`: rows,
        offsets(), visible(), bind, start, advance, mutable), or None (default: none). The step then hands their
        argmaxes back through `side_predictions`, and `side_tokens` gives a fresh request's rows."""
        return None

    def side_tokens(self) -> list[list[int]]:
        """The side rows' tokens at a request's start, for device_side's `start`."""
        raise NotImplementedError

    def side_predictions(self, values: list[float]) -> None:
        """The device step's argmax after each of device_side's rows (its read buffer's tail), before `verified`."""
        raise NotImplementedError

    def nodes(self, m: int, width: int, budget: int) -> int:
        """The most nodes besides the root draft_tree(root, m, width, budget) returns."""
        return budget if width > 1 else m

    @abstractmethod
    def verified(self, hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """The cycle settled: `tokens` is the whole verified sequence; hidden {layer: [1, S, d]} holds the target's
        states of the positions verified since the last call (S of them), for the layers asked for."""


def merged_tree(root: int, continuations, width: int, budget: int, source: str) -> DraftTree:
    """Deterministic candidates (token lists, best first) merged as a trie under `root`: shared where they agree,
    branching where they do not, at most `width` children a node and `budget` nodes besides the root."""
    tree, node_of = DraftTree(root), {}       # node_of: (parent node, token) -> node
    for continuation in continuations:
        node = 0
        for token in continuation:
            child = node_of.get((node, token))
            if child is None:
                if len(tree) > budget or len(tree.children(node)) >= width:
                    break
                child = node_of[(node, token)] = tree.add(node, Proposal(token, source=source))
            node = child
    return tree
