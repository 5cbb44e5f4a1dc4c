"""SPD's drafter: the speculation module on the pipeline's *input* states (design §1, paper Eq. 2/3)."""

from __future__ import annotations

import torch

from spd.drafters.base import Drafter, StepView
from spd.layout import depth, needed_layers
from spd.module import SpeculationModule
from spd.target.kv_cache import LayerKVCache


class ModuleDrafter(Drafter):
    def __init__(self, module: SpeculationModule, use_cache: bool = True):
        self.module = module
        self.n = module.n
        self.use_cache = use_cache

    def layers_needed(self, bounds):
        return needed_layers(bounds)

    def start(self, prompt_hidden, prompt_ids):
        self.kv = LayerKVCache(len(self.module.layers))
        self.final_rows: list[torch.Tensor] = []  # g^n rows [1, S, d] when not caching K/V
        self.num_final = 0
        self._add_final(prompt_hidden, start=0)

    def _add_final(self, hidden: dict[int, torch.Tensor], start: int) -> None:
        rows = self.module.feature(self.n, hidden)                       # [1, S, d] g^n
        count = rows.shape[1]
        if self.use_cache:
            positions = torch.arange(start, start + count, device=rows.device).view(1, -1)
            for index, (k, v) in enumerate(self.module.memory_kv_all_layers(rows, positions)):
                self.kv.update(k, v, index)
        else:
            self.final_rows.append(rows)
        self.num_final += count

    def finalize(self, pos, hidden):
        assert pos == self.num_final, "positions must reach depth n in order"
        self._add_final(hidden, start=pos)

    def on_rollback(self, length):
        # Depth-n rows are verified positions, all < length: nothing cached is ever discarded.
        assert self.num_final <= length

    @torch.no_grad()
    def draft_logits(self, view: StepView) -> torch.Tensor:
        t, occupancy = view.t, view.occupancy
        # Every position the rule gives depth n must already be final; the rest are the in-flight tokens.
        assert self.num_final == t - occupancy + 1, (self.num_final, t, occupancy)
        rows, positions = [], []
        for token in view.in_flight[:-1]:
            k = depth(t, token.pos, occupancy, self.n)
            assert k == token.depth, "pipeline depth disagrees with the layout rule"
            rows.append(self.module.feature(k, token.features))
            positions.append(token.pos)
        newest = view.in_flight[-1]
        query = self.module.feature(depth(t, newest.pos, occupancy, self.n), newest.features)  # k = 0
        if not self.use_cache and self.final_rows:
            rows = self.final_rows + rows
            positions = list(range(self.num_final)) + positions
        d = query.shape[-1]
        rows_t = torch.cat(rows, dim=1) if rows else query.new_zeros(1, 0, d)
        pos_t = torch.tensor([positions], device=query.device, dtype=torch.long).view(1, -1)
        cached = [self.kv.view(i) for i in range(len(self.module.layers))] if self.use_cache else None
        logits = self.module.forward_step(query, t, cached, rows_t, pos_t)
        return self.module.target_logits(logits)
