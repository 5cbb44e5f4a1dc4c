"""The pipelined drafters built on the speculation module: SPD (input states, drafting concurrently with the
step; design §1, paper Eq. 2/3), its output-state ablation and PPSD (both drafting after the step). The module's
`plan` (spd.layout) says which depth each row reads; this class only gathers the rows."""

from __future__ import annotations

import torch

from spd.drafters.base import AFTER_STEP, BATCHED, PIPELINED, ROLLBACK, TOGETHER, TREES, Drafter, StepView
from spd.models.module import SpeculationModule
from spd.verify.sampling import Proposal
from spd.targets.kv_cache import LayerKVCache
from spd.targets.ragged import few_rows_products


class ModuleDrafter(Drafter):
    def __init__(self, module: SpeculationModule, use_cache: bool = True):
        self.module = module
        self.plan = module.plan
        self.n = module.n
        self.use_cache = use_cache
        self.capabilities = frozenset({PIPELINED, TREES, BATCHED, TOGETHER, ROLLBACK} | ({AFTER_STEP} if self.plan.after_step
                                                                                else set()))

    def layers_needed(self, bounds=None):
        return self.plan.needed_layers(bounds)

    def start(self, prompt_hidden, tokens):
        self.kv = LayerKVCache(len(self.module.layers))
        self.final_rows: list[torch.Tensor] = []  # memory rows [1, S, d] when not caching K/V
        self.num_final = 0
        self._add_final(prompt_hidden, start=0)

    def _add_final(self, hidden: dict[int, torch.Tensor], start: int) -> None:
        rows = self.module.feature(self.plan.memory_depth(self.n), hidden)   # [1, S, d]
        count = rows.shape[1]
        if self.use_cache:
            positions = torch.arange(start, start + count, device=rows.device).view(1, -1)
            for index, (k, v) in enumerate(self.module.memory_kv_all_layers(rows, positions)):
                self.kv.update(k, v, index)
        else:
            self.final_rows.append(rows)
        self.num_final += count

    def observe(self, hidden, tokens):
        pos = len(tokens) - 1
        assert pos == self.num_final, "positions must leave the pipeline in order"
        self._add_final(hidden, start=pos)

    def rollback(self, length):
        # Rows of positions that left the pipeline are verified, all < length: nothing cached is ever discarded.
        assert self.num_final <= length

    def _row(self, t: int, occupancy: int, token) -> torch.Tensor:
        """The feature row [1, 1, d] an in-flight token gives at the depth the plan assigns it."""
        k = self.plan.depth(t, token.pos, occupancy, self.n)
        # SPD reads each token at exactly the depth it has reached; PPSD reads H^{b_1} of any deeper token
        assert k == token.depth if self.plan.single is None else k <= token.depth, \
            "pipeline depth disagrees with the layout rule"
        return self.module.feature(k, token.features)

    @torch.no_grad()
    def draft_logits(self, view: StepView) -> torch.Tensor:
        """The module's logits [V_target] for position view.t + 1."""
        t, occupancy = view.t, view.occupancy
        # Every position before the in-flight ones has left the pipeline and is a memory row already.
        assert self.num_final == t - occupancy + 1, (self.num_final, t, occupancy)
        rows = [self._row(t, occupancy, token) for token in view.in_flight[:-1]]
        positions = [token.pos for token in view.in_flight[:-1]]
        query = self._row(t, occupancy, view.in_flight[-1])
        if not self.use_cache and self.final_rows:
            rows = self.final_rows + rows
            positions = list(range(self.num_final)) + positions
        d = query.shape[-1]
        rows_t = torch.cat(rows, dim=1) if rows else query.new_zeros(1, 0, d)
        pos_t = torch.tensor([positions], device=query.device, dtype=torch.long).view(1, -1)
        cached = [self.kv.view(i) for i in range(len(self.module.layers))] if self.use_cache else None
        logits = self.module.forward_step(query, t, cached, rows_t, pos_t)
        return self.module.target_logits(logits)

    @torch.no_grad()
    def branch_logits(self, views: list[StepView]) -> torch.Tensor:
        """The module's logits [B, V_target] for position t + 1 after each of B branches of one tree level, in one
        pass: every query sees the memory rows and, of the in-flight rows (each computed once), its own branch's."""
        t, occupancy = views[0].t, views[0].occupancy
        assert self.num_final == t - occupancy + 1, (self.num_final, t, occupancy)
        slot: dict[int, int] = {}
        rows, positions = [], []
        for view in views:
            for token in view.in_flight[:-1]:
                if token.node not in slot:
                    slot[token.node] = len(rows)
                    rows.append(self._row(t, occupancy, token))
                    positions.append(token.pos)
        query = torch.cat([self._row(t, occupancy, view.in_flight[-1]) for view in views], dim=1)   # [1, B, d]
        cached = self.kv.get_seq_length(0)
        visible = torch.zeros(len(views), cached + len(rows), dtype=torch.bool)
        visible[:, :cached] = True
        for b, view in enumerate(views):
            for token in view.in_flight[:-1]:
                visible[b, cached + slot[token.node]] = True
        rows_t = torch.cat(rows, dim=1) if rows else query.new_zeros(1, 0, query.shape[-1])
        pos_t = torch.tensor([positions], device=query.device, dtype=torch.long).view(1, -1)
        kv = [self.kv.view(i) for i in range(len(self.module.layers))]
        return self.module.target_logits(self.module.forward_step(query, t, kv, rows_t, pos_t,
                                                                  visible.to(query.device)))

    @classmethod
    @torch.no_grad()
    def propose_together(cls, drafters: list["ModuleDrafter"], views: list[StepView], proposes: list) -> list:
        """Several sequences' drafts from one module in one pass: every query sees only its own sequence's memory
        (its cached K/V and its rows in flight, laid side by side under a block mask), at its own position. One
        product per layer and one head product for all of them instead of one each (two rows cost about one here,
        spd.targets.ragged.few_rows_linear)."""
        module = drafters[0].module
        if len(drafters) == 1 or any(d.module is not module or not d.use_cache for d in drafters):
            return [drafter.propose(view, choose) for drafter, view, choose in zip(drafters, views, proposes)]
        layers = range(len(module.layers))
        queries, rows, positions, sees = [], [], [], []
        for drafter, view in zip(drafters, views):
            t, occupancy = view.t, view.occupancy
            assert drafter.num_final == t - occupancy + 1, (drafter.num_final, t, occupancy)
            queries.append(drafter._row(t, occupancy, view.in_flight[-1]))
            rows += [drafter._row(t, occupancy, token) for token in view.in_flight[:-1]]
            positions += [token.pos for token in view.in_flight[:-1]]
            sees.append((drafter.kv.get_seq_length(0), len(view.in_flight) - 1))
        cached = [tuple(torch.cat([d.kv.view(i)[j] for d in drafters], dim=2) for j in (0, 1)) for i in layers]
        total = sum(c for c, _ in sees)
        visible = torch.zeros(len(drafters), total + len(rows), dtype=torch.bool)
        cache_at, row_at = 0, total
        for q, (own_cached, own_rows) in enumerate(sees):      # keys: every cache, then every row in flight
            visible[q, cache_at: cache_at + own_cached] = True
            visible[q, row_at: row_at + own_rows] = True
            cache_at, row_at = cache_at + own_cached, row_at + own_rows
        query = torch.cat(queries, dim=1)                                                  # [1, Q, d]
        rows_t = torch.cat(rows, dim=1) if rows else query.new_zeros(1, 0, query.shape[-1])
        pos_t = torch.tensor([positions], device=query.device, dtype=torch.long).view(1, -1)
        with few_rows_products():
            logits = module.forward_step(query, [view.t for view in views], cached, rows_t, pos_t,
                                         visible.to(query.device))
            logits = module.target_logits(logits)                                        # [Q, V_target]
        return [propose(row) for propose, row in zip(proposes, logits)]

    def propose(self, view: StepView, propose) -> Proposal:
        return propose(self.draft_logits(view))

    def propose_branches(self, views: list[StepView], propose) -> list:
        if len(views) == 1 or not self.use_cache:
            return [self.propose(view, propose) for view in views]
        return [propose(logits) for logits in self.branch_logits(views)]
