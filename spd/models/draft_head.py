"""The output end every trained drafter shares: an LM head over a draft vocabulary (the most frequent target
tokens), started from the target's own head rows, and the map from draft ids back to target ids."""

from __future__ import annotations

import torch
from torch import nn


class DraftHead:
    """Mixin for a drafter nn.Module: `head`, `draft_to_target` (a buffer, or None for the full vocabulary)."""

    def build_head(self, d: int, target_config, draft_to_target: torch.Tensor | None) -> None:
        vocab = target_config.vocab_size if draft_to_target is None else int(draft_to_target.numel())
        self.head = nn.Linear(d, vocab, bias=False)
        self.target_vocab_size = target_config.vocab_size
        if draft_to_target is not None:
            self.register_buffer("draft_to_target", draft_to_target.long().clone())
        else:
            self.draft_to_target = None

    @torch.no_grad()
    def copy_target_output(self, target) -> None:
        """Head rows (of the draft vocabulary) and final norm copied from the target: the draft starts out
        reading its states the way the target reads its own."""
        rows = target.model.lm_head.weight.detach()
        self.head.weight.copy_(rows if self.draft_to_target is None else rows[self.draft_to_target.to(rows.device)])
        self.norm.load_state_dict(target.decoder.norm.state_dict())

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Head logits [..., V_draft] -> [..., V_target] (-inf outside the draft vocabulary)."""
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target_vocab_size), float("-inf"))
        return full.index_copy(-1, self.draft_to_target, logits)
