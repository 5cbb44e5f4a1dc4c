"""EAGLE-3's drafter for chain decoding (`spd.runtime.chain`): m drafts in a row, then one target forward.

The draft model keeps one K/V row per verified position i, made from (embedding of x_{i+1}, f_i) with the
target's fused features f_i (the training-time test's step 0). The first draft comes from the last such row;
draft j >= 1 is a temporary row at the next position made from (embedding of draft j, the previous row's own
output), as in the test's step j. After verification the temporary rows are dropped and the verified positions
get their step-0 rows from the target's features of the verify pass.
"""

from __future__ import annotations

import torch

from spd.attention import attend_block
from spd.drafters.base import ChainDrafter
from spd.eagle3_module import Eagle3Module
from spd.sampling import Proposal
from spd.targets.kv_cache import LayerKVCache


class Eagle3Drafter(ChainDrafter):
    def __init__(self, module: Eagle3Module, embed):
        self.module = module
        self.embed = embed    # token ids [1, S] -> H^0 [1, S, d] (the target's own embedding)

    def layers_needed(self, bounds: list[int] | None = None) -> list[int]:
        """Target layers read (bounds: unused; no pipeline)."""
        return self.module.layers_needed()

    def start(self, prompt_hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """prompt_hidden: {layer: H^layer [1, P, d]}; tokens: the prompt and the first generated token (P + 1)."""
        self.kv = LayerKVCache(1)
        self.rows = 0          # verified positions with a step-0 row
        self.last_h = None     # [1, 1, d] output of the newest step-0 row (it drafts the first token)
        self.verified(prompt_hidden, tokens)

    def _run(self, embedding: torch.Tensor, h: torch.Tensor, start: int) -> torch.Tensor:
        """Rows (embedding, h) [1, S, d] at positions start.. attend to the cache and causally to each other;
        their K/V join the cache. Returns the layer's outputs [1, S, d]."""
        m = self.module
        positions = torch.arange(start, start + h.shape[1], device=h.device).view(1, -1)
        cos, sin = m.rope(positions, h)
        q, k, v = m.project(embedding, h, cos, sin)
        keys, values = self.kv.update(k, v, 0)
        s, total = h.shape[1], keys.shape[2]
        visible = torch.arange(total, device=h.device).view(1, -1) <= (total - s + torch.arange(s, device=h.device)).view(-1, 1)
        none = k.new_zeros(*k.shape[:3], 0, k.shape[-1])
        out = m.finish(h, attend_block(q, keys, values, visible.unsqueeze(0), none, none, None,
                                       m.layer.self_attn.scaling))
        return out

    @torch.no_grad()
    def verified(self, hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """Positions rows.. are verified: hidden {layer: [1, S, d]} holds their target states (S of them) and
        `tokens` the whole verified sequence (one longer: each row also reads the token after it)."""
        start = self.rows
        self.kv.crop(start)                                  # drop the drafts' temporary rows
        count = next(iter(hidden.values())).shape[1]
        ids = torch.tensor([tokens[start + 1: start + 1 + count]], device=hidden[0].device)
        out = self._run(self.embed(ids), self.module.fuse(hidden), start)
        self.rows += count
        self.last_h = out[:, -1:]

    def rewind(self, rows: int) -> None:
        """Forget every verified position from `rows` on (cost calibration re-times one update)."""
        self.kv.crop(rows)
        self.rows = rows

    @torch.no_grad()
    def draft(self, m: int, propose) -> list[Proposal]:
        """m drafts for the positions after the verified sequence; propose(logits [V_target]) -> Proposal (the
        argmax, or a sample with the q it was drawn from)."""
        drafts, h = [], self.last_h
        for j in range(m):
            if j:
                ids = torch.tensor([[drafts[-1].token]], device=h.device)
                h = self._run(self.embed(ids), h, self.rows - 1 + j)
            drafts.append(propose(self.module.target_logits(self.module.logits(h)[0, -1])))
        self.kv.crop(self.rows)
        return drafts
