"""The interface a pipelined drafter implements. The pipeline owns the target, its cache and the in-flight
slots; a drafter sees the prompt's hidden states once, each position as it reaches depth n, and the slots."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class Slot:
    """One token inside the pipeline."""

    token: int
    pos: int
    depth: int                       # stages passed so far (0 = about to enter stage 1)
    hidden: torch.Tensor             # [1, 1, d] residual stream entering the next stage
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # {layer l: H^l [1, 1, d]} seen so far
    q: torch.Tensor | None = None    # [V] the drafter's warped distribution this token was sampled from


class Drafter(ABC):
    @abstractmethod
    def start(self, prompt_hidden: dict[int, torch.Tensor], prompt_ids: list[int]) -> None:
        """prompt_hidden: {layer: H^layer [1, P, d]} for the layers the drafter asked for."""

    @abstractmethod
    def finalize(self, pos: int, hidden: dict[int, torch.Tensor]) -> None:
        """Position `pos` left the last stage (it is verified): its hidden states are final."""

    @abstractmethod
    def draft_logits(self, t: int, occupancy: int, slots: list[Slot]) -> torch.Tensor:
        """Logits [V_target] for position t+1 at the start of the step in which `slots` advance (slots[-1].pos == t)."""
