"""Draft-then-verify through the device step (spd.runtime.device_step): the decoding loop around it, which reads one
buffer a cycle. Three kinds of drafter: a context drafter (no target states: the lookup, the priced context
statistics, as a chain or a tree of W children a node) drafts on the host from what the cycle read back; a device
drafter (EAGLE-3's module, spd.drafters.eagle3_device) drafts inside the step itself, so the host only reads; none
is plain AR."""

from __future__ import annotations

import torch

from spd.decoding import Decoder, Request, context_length, is_final, prefill
from spd.drafters.base import DEVICE_SIDE, DRAWS, MARGIN, TREES, Cycle, Drafter
from spd.metrics import ChainStats
from spd.runtime.device_step import BUCKET, ROWS, DeviceStep, StepState
from spd.verify.device_sampling import choose, gumbel
from spd.verify.sampling import SamplingParams
from spd.targets.linear_states import ROLLBACK
from spd.targets.stages import StagedTarget


class DeviceChainDecoder(Decoder):
    def __init__(self, target: StagedTarget, eos_ids: frozenset[int], drafter: Drafter | None = None,
                 k: int = 7, compile: str | None = None, cuda_graphs: bool = False, width: int = 1,
                 budget: int | None = None, device_drafter=None):
        """k: draft depth a cycle; width: children per node (W; 1 = a chain); budget: drafted nodes a cycle (W > 1;
        None: k). device_drafter: drafts inside the step (then `drafter` is None and every cycle verifies its k drafts,
        or with W > 1 its tree of `budget` nodes)."""
        if drafter is not None and drafter.layers_needed():
            raise ValueError(f"{type(drafter).__name__} reads the target's hidden states; the device step hands a "
                             "host drafter only the verified tokens and the target's margin")
        if width > 1 and device_drafter is None and (drafter is None or not drafter.has(TREES)):
            raise ValueError(f"W={width}: {type(drafter).__name__} drafts chains only (W = 1)")
        self.target, self.eos_ids, self.drafter, self.device_drafter = target, eos_ids, drafter, device_drafter
        drafting = drafter is not None or device_drafter is not None
        self.k = 0 if not drafting else min(k, ROWS[-1] - 1)
        self.budget = min(budget or self.k, ROWS[-1] - 1) if width > 1 else self.k
        # a drafter's side rows (Self-Draft's branches) as fixed rows of every step; its trees as wide as it drafts
        self.side = drafter.device_side(target.device) if drafter is not None and drafter.has(DEVICE_SIDE) else None
        if drafter is not None:
            self.budget = drafter.nodes(self.k, width, self.budget)
        if width > 1 and device_drafter is not None:    # a fixed tree: as many nodes as it has candidates at most
            self.budget = min(self.budget, device_drafter.candidates(self.k, width))
        self.width = 1 if device_drafter is not None and self.budget < 2 else width
        self.buckets = [self.budget + 1] if device_drafter is not None else \
            sorted(set(r for r in ROWS if r < self.budget + 1) | {self.budget + 1})
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self.state: StepState | None = None
        self.steps: dict[int, DeviceStep] = {}

    def state_for(self, cache, params: SamplingParams) -> StepState:
        """The shared state over this cache, and its steps (built, and compiled, again only for a new cache
        length bucket, or greedy against sampled: other sampling settings refill the state's tensors)."""
        if self.state is not None and self.state.cache is cache and self.state.sampling.greedy == params.greedy:
            self.state.sampling.set(params)
        else:
            self.state = StepState(self.target, cache, self.budget + 1, params, self.side)
            # every bucket's graph in one memory pool: one bucket replays at a time, its outputs in the state
            pool = torch.cuda.graph_pool_handle() if self.cuda_graphs and self.target.device.type == "cuda" else None
            self.steps = {rows: DeviceStep(self.target, self.state, rows, self.compile, self.cuda_graphs,
                                           tree=self.width > 1 and rows > 2, drafter=self.device_drafter, pool=pool)
                          for rows in self.buckets}
        return self.state

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        target, params = self.target, request.params
        generator = request.generator(target.device)
        # the cache's length in buckets: a step is built (and compiled) once per bucket, not once per prompt
        ahead = self.budget + 1 + (self.side.rows if self.side is not None else 0)
        length = -(-context_length(len(prompt_ids), request.max_new_tokens, ahead) // BUCKET) * BUCKET
        capture = frozenset(self.device_drafter.layers_needed()) if self.device_drafter else frozenset()
        # a hybrid's linear layers keep the states of every row a step writes (spd.targets.linear_states)
        cache, hidden, captured = prefill(target, prompt_ids, capture, length, self.state and self.state.cache,
                                          max(ROLLBACK, ahead))
        logits = target.logits(hidden[0, -1])                                          # [V]
        draws = None if params.greedy else request.draws(generator, logits.shape[-1])
        state = self.state_for(cache, params)
        state.position.fill_(len(prompt_ids))
        # two host slots (pinned on CUDA): where nothing drafts on the host (AR, a device drafter) the next cycle is
        # launched before the previous one's values are read, so the device never waits on the host's read
        host = torch.zeros(2, len(state.out), dtype=torch.float64, pin_memory=target.device.type == "cuda")
        overlap, pending, self.events = self.drafter is None, None, [None, None]
        # the first token from the prefill's last row, by the same rule as every later one
        if draws is not None:
            state.key.fill_(draws.key)
        noise = None if draws is None else gumbel(state.key, torch.tensor([len(prompt_ids)], device=target.device),
                                                   state.vocab)
        state.tokens[:1] = choose(logits.view(1, -1), params, noise)
        top2 = logits.float().topk(2).values
        state.out[0], state.out[1], state.out[2] = 1, top2[0] - top2[1], state.tokens[0]
        if self.device_drafter is not None:
            self.device_drafter.bind(cache.max_length, state.tokens[1:], self.k, self.width,
                                     state if self.width > 1 else None)
            self.device_drafter.start(captured, torch.cat([torch.tensor(prompt_ids, device=target.device),
                                                           state.tokens[:1]]))
            state.drafts.fill_(self.budget)
        values = self.read(state, host[0])
        tokens = list(prompt_ids)
        stats = self.stats = ChainStats(m=self.k)
        while True:
            count, margin, chosen = int(values[0]), values[1], values[2:]
            if self.side is not None and stats.cycles:    # the side rows' drafts, before the cycle's tokens settle
                self.drafter.side_predictions(values[2 + state.tree_rows:])
            for token in chosen[:count]:
                tokens.append(int(token))
                stats.N += 1
                yield tokens[-1]
                if is_final(tokens[-1], stats.N, request.max_new_tokens, self.eos_ids):
                    return
            rows = self.buckets[-1]
            drafted = self.k
            if self.drafter is not None:
                if stats.N == 1:
                    self.drafter.start({}, tokens)
                    if self.drafter.has(DRAWS):
                        self.drafter.sampling_draws(draws)
                    if self.side is not None:
                        self.side.start(self.drafter.side_tokens())
                else:
                    self.drafter.observe({}, tokens)
                cycle = Cycle(tokens[-1], self.k, self.width, self.budget,
                              margin if self.drafter.has(MARGIN) else None)
                tree = self.drafter.propose(cycle, None)
                drafted = len(tree) - 1
                rows = next(r for r in self.buckets if r > drafted)
                if drafted:
                    state.tokens[1: 1 + drafted].copy_(torch.tensor(tree.tokens()[1:]), non_blocking=True)
                if self.steps[rows].tree:
                    state.set_tree(tree, rows)
                state.drafts.fill_(drafted)
            step = self.steps[rows]
            if not overlap:
                step.run()
                values = self.read(state, host[0])
            else:
                if pending is None:
                    pending = self.launch(step, state, host, 0)
                # the cycle after: it yields at least one token more unless this one ends the request
                later = self.launch(step, state, host, 1 - pending) if stats.N + 1 < request.max_new_tokens else None
                values = self.collect(host, pending)
                pending = later
            stats.cycle(drafted, int(values[0]) - 1)

    def read(self, state: StepState, host: torch.Tensor) -> list[float]:
        """The cycle's one read: the state's `out` copied into the host buffer (pinned on CUDA, non-blocking)."""
        host[: len(state.out)].copy_(state.out, non_blocking=True)
        if host.is_pinned():
            torch.cuda.current_stream(self.target.device).synchronize()
        return host.tolist()

    def launch(self, step: DeviceStep, state: StepState, host: torch.Tensor, slot: int) -> int:
        """A cycle run and its `out` sent to host[slot] without waiting (on CUDA an event marks the copy's end; the
        next replay, queued after the copy on the same stream, cannot overwrite `out` before it is read)."""
        step.run()
        host[slot].copy_(state.out, non_blocking=True)
        if host.is_pinned():
            self.events[slot] = torch.cuda.Event()
            self.events[slot].record(torch.cuda.current_stream(self.target.device))
        return slot

    def collect(self, host: torch.Tensor, slot: int) -> list[float]:
        """A launched cycle's values, once its copy has landed."""
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return host[slot].tolist()
