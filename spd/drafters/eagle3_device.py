"""EAGLE-3's chain drafted inside the device step (spd.runtime.device_step): the module's K/V in a static cache, its
rows written at their positions, so that a cycle's update (the verified positions' step-0 rows from the target's
fused features) and its m drafts are tensors in, tensors out — no host read, one compiled graph with the target's
forward. The same module and the same rows as spd.drafters.eagle3; drafts are the module's argmax (deterministic),
so verification keeps each with exactly the target's probability and the output is the target's own at every T.

A step-0 row for verified position i sits at slot i; draft j >= 1 of a cycle is a temporary row at the slot after
the newest verified position + j - 1, overwritten by the next cycle's step-0 rows (the mask hides what lies past a
row's own position, so a stale temporary row is never read)."""

from __future__ import annotations

import torch

from spd.attention import attend_block
from spd.eagle3_module import Eagle3Module


class Eagle3DeviceDrafter:
    def __init__(self, module: Eagle3Module, embed):
        self.module = module
        self.embed = embed    # token ids [1, S] -> H^0 [1, S, d] (the target's own embedding)
        self.keys = None

    def layers_needed(self) -> list[int]:
        return self.module.layers_needed()

    def mutable(self) -> list[torch.Tensor]:
        """What a step writes that the next step reads (a CUDA graph's warm-ups restore it)."""
        return [self.last_h, self.rows]

    @torch.no_grad()
    def start(self, length: int, hidden: dict[int, torch.Tensor], prompt_ids: list[int], root: torch.Tensor,
              drafts: torch.Tensor) -> None:
        """A static cache of `length` slots, the prompt's step-0 rows (hidden {layer: [1, P, d]}; each row also
        reads the token after it, the root [1] last), and the first drafts written into drafts [m]."""
        m, device = self.module, root.device
        attn = m.layer.self_attn
        kv_heads = m.config.num_key_value_heads
        if self.keys is None or self.keys.shape[2] != length:
            self.keys = torch.zeros(1, kv_heads, length, attn.head_dim, device=device, dtype=m.fc.weight.dtype)
            self.values = torch.zeros_like(self.keys)
            self.slots = torch.arange(length, device=device)                          # [S]
            self.last_h = torch.zeros(1, 1, m.config.hidden_size, device=device, dtype=m.fc.weight.dtype)
            self.rows = torch.zeros((), dtype=torch.long, device=device)               # [] verified step-0 rows
        ids = torch.cat([torch.tensor(prompt_ids[1:], device=device), root]).view(1, -1)  # [1, P]
        self.update(hidden, ids[0], torch.tensor(len(prompt_ids) - 1, device=device),
                    torch.zeros((), dtype=torch.long, device=device))
        self.draft(root, drafts)

    def _run(self, embedding: torch.Tensor, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows (embedding, h) [1, r, d] at positions [r] (their slots): their K/V written there, each attending
        to every slot up to its own position. Returns the layer's outputs [1, r, d]."""
        m = self.module
        cos, sin = m.rope(positions.view(1, -1), h)
        q, k, v = m.project(embedding, h, cos, sin)
        self.keys.index_copy_(2, positions, k)
        self.values.index_copy_(2, positions, v)
        visible = self.slots.view(1, -1) <= positions.view(-1, 1)                      # [r, S]
        none = k.new_zeros(*k.shape[:3], 0, k.shape[-1])
        return m.finish(h, attend_block(q, self.keys, self.values, visible.unsqueeze(0), none, none, None,
                                        m.layer.self_attn.scaling))

    def update(self, hidden: dict[int, torch.Tensor], verified: torch.Tensor, kept: torch.Tensor,
               position: torch.Tensor) -> None:
        """The cycle's rows, root first along the accepted path (hidden {layer: [1, r, d]}), and verified [r] (the
        token after each): step-0 rows for positions position.. (those past `kept` are hidden until rewritten);
        the newest kept row's output drafts next."""
        r = verified.shape[0]
        positions = position + torch.arange(r, device=verified.device)                # [r]
        out = self._run(self.embed(verified.view(1, -1)), self.module.fuse(hidden), positions)   # [1, r, d]
        self.last_h.copy_(out.index_select(1, kept.view(1)))
        self.rows.copy_(position + kept + 1)

    def draft(self, root: torch.Tensor, drafts: torch.Tensor) -> None:
        """drafts [m] <- the chain after the newest verified token root [1] (greedy in the module's own q)."""
        h, previous = self.last_h, root                                                # [1, 1, d], [1]
        for j in range(drafts.shape[0]):
            if j:
                h = self._run(self.embed(previous.view(1, 1)), h, (self.rows + j - 1).view(1))
            token = self.module.target_logits(self.module.logits(h))[0, -1].argmax().view(1)   # [1]
            drafts[j: j + 1] = token
            previous = token


def device_drafter(*, module: Eagle3Module, embed) -> Eagle3DeviceDrafter:
    """EAGLE-3's drafter inside the device step (spd.methods): its module, fed the target's embedding."""
    return Eagle3DeviceDrafter(module, embed)
