"""What the decoding loop asks of whatever runs the target's stages (in-process, one process per stage, ...).

The loop follows `spd.runtime.schedule`; an executor only moves hidden states: it embeds tokens, prefills,
starts a step (every stage advances the position the schedule gives it), hands back what the step produced, and
forgets positions on a rollback. `launch` may return before the stages finish, so the drafter runs meanwhile.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from spd.runtime.flight import Flight
from spd.verify.tree_rows import StageRows
from spd.runtime.schedule import Step


@dataclass
class StepOutput:
    # {node: {layer: H^l [1, 1, d]}} captured by the stages that ran, for the layers the drafter asked for (a
    # chain's node ids are its positions, spd.runtime.flight)
    features: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    exit_logits: torch.Tensor | None = None   # [V] target logits of step.exiting (the next position's p); [k, V]
                                              # when a segment of k nodes leaves (spd.runtime.segments)
    exit_nodes: list[int] = field(default_factory=list)   # the nodes that left the last stage, in exit_logits' order
    exit_argmax: int | list[int] | None = None   # instead of exit_logits, where the executor was told argmax
                                                 # suffices (a list: one per node of an exiting segment)


def level_mask(rows: StageRows, nodes: list[int], flight: Flight, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a stage's run of a level needs beyond positions: None where every cached row is visible (a chain: the
    plain causal path), else (visible [k, S] bool, key positions [S]) for `run_layers(visible=)`."""
    if rows.sees_all(nodes, flight):
        return None
    visible, keys = rows.visible(nodes, flight)
    return to_device(visible, torch.bool, device), to_device(keys, torch.long, device)


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list on `device` without a sync: through pinned memory and an asynchronous copy on CUDA (a plain
    `torch.tensor(..., device=cuda)` waits for the copy, stalling the host mid-step)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class StageExecutor(ABC):
    trees = False   # True: runs tree levels of several nodes (W > 1) under their masks, and prunes them
    segments = False  # True: runs FlowSpec's segments (nodes at several positions, spd.runtime.segments)
    shared = False  # True: one sequence's view of stages that run several sequences' rows together (spd.runtime.seed)
    n: int
    bounds: list[int]
    device: torch.device

    @abstractmethod
    def embed(self, token: int) -> torch.Tensor:
        """H^0 [1, 1, d] of one token."""

    @abstractmethod
    def prefill(self, prompt_ids: list[int], capture: frozenset[int], max_length: int | None = None,
                argmax_exit: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """All stages over the prompt (fresh caches, static ones of max_length positions where the executor keeps
        them). Returns (logits [V] of the last position, {l: H^l [1, P, d]}) for l in `capture`; later steps
        capture the same layers. argmax_exit: the loop verifies greedily, so the steps may hand back the exiting
        token's argmax (`exit_argmax`) instead of its logits, where moving the logits costs (between processes)."""

    @abstractmethod
    def launch(self, step: Step, entering: torch.Tensor | None, flight: Flight | None = None) -> None:
        """Start `step`. entering: H^0 [1, k, d] of the k nodes at step.work[0]'s position when stage 1 runs, else
        None. flight: the nodes in flight (None, or a chain: one node per position, its id the position)."""

    @abstractmethod
    def collect(self) -> StepOutput:
        """Wait for the step started by the last `launch` and return what it produced."""

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget every position >= length in every stage (caches cropped, in-flight states dropped)."""

    def prune(self, flight: Flight) -> None:
        """Forget every tree node the flight dropped (a verified child kept only its subtree), in every stage."""
        raise NotImplementedError(f"{type(self).__name__} runs chains only (W = 1)")

    def finish(self) -> None:
        """The generation ended (the stages may go idle until the next prefill)."""

    def close(self) -> None:
        """Release whatever the executor holds (processes, groups)."""
