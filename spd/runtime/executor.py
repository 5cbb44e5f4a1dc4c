"""What the decoding loop asks of whatever runs the target's stages (in-process, one process per stage, ...).

The loop follows `spd.runtime.schedule`; an executor only moves hidden states: it embeds tokens, prefills,
starts a step (every stage advances the position the schedule gives it), hands back what the step produced, and
forgets positions on a rollback. `launch` may return before the stages finish, so the drafter runs meanwhile.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from spd.runtime.schedule import Step


@dataclass
class StepOutput:
    # {pos: {layer: H^l [1, 1, d]}} captured by the stages that ran, for the layers the drafter asked for
    features: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    exit_logits: torch.Tensor | None = None   # [V] target logits of step.exiting (the next position's p)
    exit_argmax: int | None = None            # instead of exit_logits, where the executor was told argmax suffices


class StageExecutor(ABC):
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
    def launch(self, step: Step, entering: torch.Tensor | None) -> None:
        """Start `step`. entering: H^0 [1, 1, d] of step.work[0]'s position when stage 1 runs, else None."""

    @abstractmethod
    def collect(self) -> StepOutput:
        """Wait for the step started by the last `launch` and return what it produced."""

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget every position >= length in every stage (caches cropped, in-flight states dropped)."""

    def finish(self) -> None:
        """The generation ended (the stages may go idle until the next prefill)."""

    def close(self) -> None:
        """Release whatever the executor holds (processes, groups)."""
