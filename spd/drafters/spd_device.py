"""SPD's (and PPSD's, the output states') drafter inside the device pipeline step (spd.runtime.device_pipeline): the
speculation module's memory K/V in a static cache, its draft for the next position from the in-flight tokens'
features, and the memory row of each position that leaves the pipeline — tensors in, tensors out, no host read.
The same module, plan and rows as spd.drafters.spd_module, drafting by the module's argmax (deterministic, so each
draft is kept exactly when it is the target's own choice there, and the output is AR's at every T).

draft_source=lookup+module puts the context lookup in front (spd.drafters.hybrid.LookupThenModule's rule): on the
host, from the tokens each step reads back, the lookup's token for the next position where the context's suffix
matched earlier, handed to the step in two tensors before it runs (`front`), which the step's draft takes instead
of the module's."""

from __future__ import annotations

import torch

from spd.drafters.base import AFTER_STEP, DEVICE, HOST_FRONT, PIPELINED, DeviceStepView, Drafter
from spd.drafters.lookup import NgramIndex
from spd.methods import LOOKUP_MODULE
from spd.models.attention import layer_forward, memory_kv
from spd.models.module import SpeculationModule
from spd.spec import LookupOptions


class SpdDeviceDrafter(Drafter):
    def __init__(self, module: SpeculationModule, lookup: tuple[int, int] | None = None):
        """lookup: (min_n, max_n) for draft_source=lookup+module (the lookup in front of the module)."""
        self.module, self.plan, self.lookup = module, module.plan, lookup
        self.capabilities = frozenset({PIPELINED, DEVICE} | ({HOST_FRONT} if lookup else set()) |
                                      ({AFTER_STEP} if module.plan.after_step else set()))
        self.memory = None

    def layers_needed(self, bounds=None) -> list[int]:
        return self.plan.needed_layers(bounds if bounds is not None else self.module.bounds)

    def mutable(self) -> list[torch.Tensor]:
        """Nothing a graph's warm-ups must restore: a step writes the memory only at verified positions (or the
        scratch slot), which the captured step writes again with the same rows."""
        return []

    def bind(self, length: int, n: int, device: torch.device, dtype: torch.dtype) -> None:
        """A request's buffers: the memory's K/V for `length` positions (the last the scratch slot idle stages write)
        and the n - 1 lag rows' slots, and the lookup's draft; a pipeline of n stages."""
        module = self.module
        self.n = n
        self.column = {layer: i for i, layer in enumerate(self.layers_needed())}
        # the depth each lag's feature is read at when the pipeline is full (only validity changes with a)
        self.depths = [self.plan.depth(n - 1, n - 1 - j, n, n) for j in range(n)]     # lag j -> depth k
        self.memory_depth = self.plan.memory_depth(n)
        self.keys = torch.arange(length, device=device).view(1, -1)                    # [1, S]
        self.lags = torch.arange(n, device=device)                                     # [n]
        attn = module.layers[0].self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        # per layer K, V [1, H, S + n - 1, hd]: the memory's S positions, then the n - 1 lag rows' slots, which every
        # draft rewrites in place (concatenating them would copy the whole memory each step)
        self.memory = [(torch.zeros(1, kv_heads, length + n - 1, attn.head_dim, device=device, dtype=dtype),
                        torch.zeros(1, kv_heads, length + n - 1, attn.head_dim, device=device, dtype=dtype))
                       for _ in module.layers]
        # draft_source=lookup+module: the lookup's draft for the next position, where it found one (written by
        # `front` before the step)
        self.found = torch.zeros(1, dtype=torch.long, device=device)                  # [1]
        self.looked = torch.zeros((), dtype=torch.bool, device=device)                 # []

    def start(self, prompt_hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        """The prompt's memory rows (prompt_hidden {layer: [1, P, d]}); tokens: the prompt and the first token in
        flight (P + 1), the lookup's context."""
        rows = self.module.feature(self.memory_depth, prompt_hidden)                  # [1, P, d]
        self.write_memory(rows, torch.arange(rows.shape[1], device=rows.device))
        if self.lookup:
            self.index = NgramIndex(*self.lookup)      # every position up to the newest in flight
            self.index.extend(list(tokens))

    def write_memory(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Memory rows [1, r, d] at positions [r]: their K/V in the module's static cache."""
        cos, sin = self.module.rope(positions.view(1, -1), rows)
        for layer, (keys, values) in zip(self.module.layers, self.memory):
            k, v = memory_kv(layer, rows, cos, sin)
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)

    def feature(self, states: torch.Tensor, depth: int, lag: int) -> torch.Tensor:
        """g^depth [1, 1, d] of the token at `lag` from its states [n, layers, d]."""
        return self.module.feature(depth, {l: states[lag, self.column[l]].view(1, 1, -1)
                                           for l in self.module.feature_layers[depth]})

    def propose(self, view: DeviceStepView, choose=None) -> torch.Tensor:
        """The token [1] for position t + 1: the lookup's where `front` found one, else the module's from G_t —
        memory rows before the in-flight tokens, each in-flight token's feature at its depth, the newest's as the
        query."""
        return torch.where(self.looked, self.found, self.module_draft(view))           # [1]

    def module_draft(self, view: DeviceStepView) -> torch.Tensor:
        module, n, (states, t, a) = self.module, self.n, view
        query = self.feature(states, self.depths[0], 0)                                # [1, 1, d]
        cos, sin = module.rope(t.view(1, 1), query)
        rows = torch.cat([self.feature(states, self.depths[j], j) for j in range(1, n)], 1) if n > 1 else None
        lag_positions = (t - self.lags[1:]).clamp(min=0).view(1, -1)                   # [1, n-1]
        visible = torch.cat([self.keys < t - a + 1,                                    # [1, S + n - 1]: memory,
                             (self.lags[1:] < a).view(1, -1)], 1)                      # then the lags in flight
        if rows is not None:                                                           # rows [1, n-1, d]
            rcos, rsin = module.rope(lag_positions, rows)
        hidden = query
        for layer, (keys, values) in zip(module.layers, self.memory):
            if rows is not None:        # the last n - 1 slots
                keys[:, :, 1 - n:], values[:, :, 1 - n:] = memory_kv(layer, rows, rcos, rsin)
            hidden = layer_forward(layer, hidden, cos, sin, keys, values, visible.view(1, 1, -1))
        return module.target_logits(module.head(module.norm(hidden))[0, -1]).argmax().view(1)   # [1]

    def observe(self, states: torch.Tensor, position: torch.Tensor) -> None:
        """The exiting token's states [n, layers, d] at lag n - 1 are verified: its memory row at `position` [1]
        (the scratch slot where nothing exits)."""
        self.write_memory(self.feature(states, self.memory_depth, self.n - 1), position)

    def front(self, t: int) -> str:
        """HOST_FRONT, before a step: the lookup's draft for position t + 1 into the step's tensors where the
        context matched earlier; returns the source that drafts there."""
        matched, start = self.index.match()
        self.looked.fill_(bool(matched))
        if matched:
            self.found.fill_(self.index.continuation(start, 1)[0])
        return "lookup" if matched else "module"

    def read_back(self, t: int, newest: int) -> None:
        """HOST_FRONT, after a step: the context up to the newest position t in flight (a flush takes the drafts
        back), its newest token joining."""
        self.index.truncate(t)
        self.index.extend([newest])


def device_drafter(*, module: SpeculationModule, draft_source: str, lookup: LookupOptions) -> SpdDeviceDrafter:
    """The pipelined methods' drafter inside the device step (spd.methods): the module, the lookup in front where
    draft_source says so."""
    return SpdDeviceDrafter(module, (lookup.min_ngram, lookup.max_ngram) if draft_source == LOOKUP_MODULE else None)
