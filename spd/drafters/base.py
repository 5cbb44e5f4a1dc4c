"""The one contract every drafter implements, host or device, pipelined or draft-then-verify.

A drafter has four calls — `layers_needed` (the target layers whose states it reads), `start` (a request's prompt),
`propose` (its drafts, and where sampled their q) and `observe` (what was verified) — and says what else it can do
in `capabilities`, a set of the names below. A runtime asks `capabilities`, never the class; `check_contract` says
whether a drafter has every hook its capabilities promise. What `propose` is asked, and what `observe` is told,
depends on where the drafter drafts:

| declared     | propose(ask, choose)                                  | observe(hidden, tokens)                         |
|--------------|-------------------------------------------------------|-------------------------------------------------|
| PIPELINED    | ask: a `StepView` of the pipeline step (spd.runtime.   | a position left the last stage: tokens is the   |
|              | pipeline); returns the next position's `Proposal`     | verified sequence through it, hidden {layer:    |
|              | (TREES: propose's ranked children, W > 1)             | [1, 1, d]} its states                           |
| CHAIN        | ask: a `Cycle` (the newest verified token, depth,     | a cycle settled: tokens is the verified         |
|              | width, node budget, the target's margin); returns a   | sequence, hidden {layer: [1, S, d]} the states  |
|              | `DraftTree` (W = 1: a chain; the root alone: no draft)| of the S positions verified since the last call |
| DEVICE       | inside the device step, tensors in, tensors out: ask  | the cycle's states along the accepted path      |
| (with CHAIN) | is the newest verified token [1]; the drafts go into  | {layer: [1, r, d]} and `DeviceVerified` tensors |
|              | the buffers `bind` gave (start: tokens [P + 1])       |                                                 |
| DEVICE (with | inside the device pipeline step: ask is the step's    | the in-flight states [n, layers, d] when the    |
| PIPELINED)   | `DeviceStepView` (in-flight states, t, a); returns    | oldest leaves the last stage, and the position  |
|              | the draft [1] (start: tokens P + 1, the first in      | [1] its row goes to (the scratch slot where     |
|              | flight last)                                          | none exits)                                     |

`choose(logits [V]) -> Proposal` is the run's rule for a drafter that has logits (argmax, or a sample with its q; in a
pipelined tree, the W likeliest children); a drafter without logits proposes Proposal(token, source=...), which
verification treats as deterministic (q = None)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import torch

from spd.verify.sampling import Proposal
from spd.verify.tree import DraftTree


# What a drafter can declare in `capabilities`, and the hooks (methods or attributes) each one promises.
PIPELINED = "pipelined"    # drafts one token per pipeline step, beside it (spd.runtime.pipeline, seed, device_pipeline)
CHAIN = "chain"            # drafts a tree below the newest verified token, verified in one forward (spd.runtime.chain,
                           # batch, device_chain; FlowSpec's segments, spd.runtime.segments)
TREES = "trees"            # proposes more than one child a node (W > 1)
AFTER_STEP = "after_step"  # PIPELINED: reads the step's outputs, so it drafts after the step, not beside it
ROLLBACK = "rollback"      # PIPELINED: keeps state about positions in flight, told when a rejection drops them
BATCHED = "batched"        # PIPELINED TREES: a tree level's tips drafted in one pass
TOGETHER = "together"      # PIPELINED: several sequences' drafters of its class draft in one pass (SEED's schedule)
MARGIN = "margin"          # CHAIN: prices with the target's top-2 margin, so the runtime computes `Cycle.margin`
DRAWS = "draws"            # sees a sampled request's keyed draws (spd.verify.sampling.KeyedDraws) after `start`
SIDE_ROWS = "side_rows"    # CHAIN: rows of its own ride in the verification forward (Self-Draft's branches)
DEVICE_SIDE = "device_side"  # SIDE_ROWS: ... as fixed rows of the device step too
DEVICE = "device"          # drafts inside the device step (spd.runtime.device_step, device_pipeline)
HOST_FRONT = "host_front"  # DEVICE PIPELINED: a host-side draft in front of the device's, handed to each step before
                           # it runs (the context lookup, from the tokens each step reads back)

HOOKS: dict[str, tuple[str, ...]] = {
    ROLLBACK: ("rollback",),
    BATCHED: ("propose_branches",),
    TOGETHER: ("propose_together",),
    DRAWS: ("sampling_draws",),
    SIDE_ROWS: ("side_rows", "side_logits", "extra_rows"),
    DEVICE_SIDE: ("device_side", "side_tokens", "side_predictions"),
    DEVICE: ("bind", "mutable"),
    HOST_FRONT: ("front", "read_back"),
}
# a DEVICE CHAIN TREES drafter also sizes its fixed tree (spd.runtime.device_chain)
COMBINED_HOOKS: dict[frozenset[str], tuple[str, ...]] = {frozenset({DEVICE, CHAIN, TREES}): ("candidates",)}


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
    """What a PIPELINED drafter is asked (it must not change any of it): a step at its start, or after it for a
    drafter that drafts AFTER_STEP (then every token is one stage deeper and the oldest may just have left the last
    one)."""

    t: int                               # position of the newest token (the one that entered stage 1)
    occupancy: int                       # tokens in flight when the step began, the newest included
    n: int
    in_flight: tuple[InFlight, ...]      # oldest first; in_flight[-1].pos == t (depth 0 before the step, 1 after)


class Cycle(NamedTuple):
    """What a CHAIN drafter is asked each cycle: drafts below `root`, the newest verified token, as a tree, parents
    first — depth <= m, at most `width` children a node, at most `budget` nodes besides the root."""

    root: int
    m: int
    width: int = 1
    budget: int = 0
    margin: float | None = None          # the target's top-2 logit margin where it chose `root` (MARGIN drafters)


class DeviceVerified(NamedTuple):
    """What a DEVICE drafter observes each cycle beside the target's states of the rows along the accepted path
    (root first): the token after each row [r], the kept drafts [] and the root's position [], as device tensors."""

    tokens: torch.Tensor
    kept: torch.Tensor
    position: torch.Tensor


class DeviceStepView(NamedTuple):
    """What a PIPELINED DEVICE drafter is asked each step, as the step's own tensors: every in-flight token's
    captured states by lag (states [n, layers, d], the layers in layers_needed's order; lag 0 the newest), the
    newest position t [] and the occupancy a []."""

    states: torch.Tensor
    t: torch.Tensor
    a: torch.Tensor


class Drafter(ABC):
    capabilities: frozenset[str] = frozenset()

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def layers_needed(self, bounds: list[int] | None = None) -> list[int]:
        """Target layers l whose H^l this drafter reads (0 = the embedding), for a pipeline with these bounds (a
        CHAIN drafter runs no pipeline: bounds unused). Default: none."""
        return []

    def start(self, prompt_hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """A request begins. prompt_hidden: {layer: H^layer [1, P, d]} for the layers asked for; tokens: the prompt
        (PIPELINED), or the prompt and the first generated token (CHAIN, DEVICE: P + 1)."""

    @abstractmethod
    def propose(self, ask, choose):
        """The drafts for `ask` (the table above)."""

    @abstractmethod
    def observe(self, hidden, tokens) -> None:
        """What was verified since the last call (the table above)."""

    def nodes(self, m: int, width: int, budget: int) -> int:
        """CHAIN: the most nodes besides the root that propose(Cycle(root, m, width, budget)) returns."""
        return budget if width > 1 else m


def check_contract(drafter: Drafter) -> Drafter:
    """The drafter, if it has every hook its capabilities promise; else a TypeError naming what is missing."""
    caps = drafter.capabilities
    kinds = [kind for kind in (PIPELINED, CHAIN) if kind in caps]
    if len(kinds) != 1:
        raise TypeError(f"{type(drafter).__name__} must declare exactly one of {PIPELINED!r}, {CHAIN!r} in its "
                        f"capabilities (it declares {sorted(caps)})")
    promised = [hook for cap in caps for hook in HOOKS.get(cap, ())]
    promised += [hook for together, hooks in COMBINED_HOOKS.items() if together <= caps for hook in hooks]
    missing = [hook for hook in promised if not hasattr(drafter, hook)]
    if missing:
        raise TypeError(f"{type(drafter).__name__} declares {sorted(caps)} but lacks {', '.join(missing)}")
    return drafter


def propose_level(drafter: Drafter, views: list[StepView], choose) -> list:
    """A PIPELINED TREES drafter's children for every tip of a tree level, in one pass where it is BATCHED."""
    if drafter.has(BATCHED):
        return drafter.propose_branches(views, choose)
    return [drafter.propose(view, choose) for view in views]


def propose_together(drafters: list[Drafter], views: list[StepView], chooses: list) -> list[Proposal]:
    """Several sequences' PIPELINED drafters (SEED's schedule: every sequence sharing a pipeline step drafts at
    once), each on its own view with its own choose: those of one class that drafts TOGETHER in one call."""
    out: list = [None] * len(drafters)
    kinds: dict[type, list[int]] = {}
    for i, drafter in enumerate(drafters):
        kinds.setdefault(type(drafter) if drafter.has(TOGETHER) else None, []).append(i)
    for kind, group in kinds.items():
        if kind is None:
            drafted = [drafters[i].propose(views[i], chooses[i]) for i in group]
        else:
            drafted = kind.propose_together([drafters[i] for i in group], [views[i] for i in group],
                                            [chooses[i] for i in group])
        for i, proposal in zip(group, drafted):
            out[i] = proposal
    return out


class WrappedDrafter(Drafter):
    """Forwards every call to `inner` (a PIPELINED drafter) and declares what it declares, batching aside (a batched
    pass would skip the wrapper's own `propose`); a subclass overrides what it changes (the drafts it returns,
    timing, ...)."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.capabilities = inner.capabilities - {BATCHED, TOGETHER}

    def layers_needed(self, bounds=None):
        return self.inner.layers_needed(bounds)

    def start(self, prompt_hidden, tokens):
        self.inner.start(prompt_hidden, tokens)

    def propose(self, ask, choose):
        return self.inner.propose(ask, choose)

    def observe(self, hidden, tokens):
        self.inner.observe(hidden, tokens)

    def rollback(self, length):
        if self.inner.has(ROLLBACK):
            self.inner.rollback(length)


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
