"""A draft-then-verify cycle as one function of device tensors with fixed shapes (gpt-fast's static cache, SGLang's
on-device acceptance): the target's forward over the newest verified token and k drafts, the target's own choice
after every row (greedy, or the keyed Gumbel-max draw), acceptance as the longest run of drafts equal to those
choices, and the next cycle's inputs written in place. k = 0 is plain AR.

Nothing inside the step is read back to the host: the rollback is the position tensor itself (the static cache's
rows past a query's position are hidden by its mask and overwritten by the next step), so a step launches the same
kernels on the same memory every time, which `torch.compile(fullgraph=True)` compiles whole and a CUDA graph can
replay. The decoder around it reads one thing a cycle, the verified tokens and their count, as one copy into a host
buffer (pinned on CUDA) — which a context drafter needs on the host anyway to draft the next cycle."""

from __future__ import annotations

import torch

from spd.decoding import Decoder, Request, context_length, is_final, prefill
from spd.drafters.base import ChainDrafter
from spd.metrics import ChainStats
from spd.sampling import SamplingParams, warp
from spd.targets.fixed_step import WARMUP_RUNS
from spd.targets.linears import plain_products
from spd.targets.stages import StagedTarget


BUCKET = 512     # positions: a static cache's length is a multiple of this
ROWS = (1, 2, 4, 8, 16)   # rows a step runs: a cycle's drafts are padded up to the next of these


def gumbel(draws, position: int, rows: int) -> torch.Tensor:
    """The keyed Gumbel noise -log(-log u) of `rows` positions from `position` on [rows, V] (float64, host): what
    KeyedDraws.sample adds to log p there."""
    return -torch.log(-torch.log(torch.stack([draws.uniforms(position + j) for j in range(rows)])))


class StepState:
    """What every step of one cache shares, in device tensors: `tokens` [R] (the root, then its drafts), `drafts` []
    (how many of tokens[1:] are real; the rest are padding that is never kept), `position` [] (the root's position),
    `noise` [R, V] (sampling: the Gumbel noise of the positions the rows choose), `out` [R + 2] (what the host reads:
    the count c of verified tokens, the target's margin where it chose the last of them, its choice after each row;
    float64 holds token ids exactly)."""

    def __init__(self, target: StagedTarget, cache, rows: int, params: SamplingParams):
        if not cache.static:
            raise ValueError("a device step needs a static cache (new_cache(max_length=...))")
        device = target.device
        self.cache, self.params = cache, params
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)               # [R]
        self.drafts = torch.zeros((), dtype=torch.long, device=device)                 # []
        self.position = torch.zeros((), dtype=torch.long, device=device)               # []
        self.out = torch.zeros(rows + 2, dtype=torch.float64, device=device)           # [R+2]
        self.mask_keys = torch.arange(cache.max_length, device=device).view(1, -1)     # [1, S]
        vocab = target.model.config.vocab_size
        self.noise = None if params.greedy else \
            torch.zeros(rows, vocab, dtype=torch.float64, device=device)              # [R, V]


class DeviceStep:
    """One cycle over the first `rows` of the shared state (the root and up to rows - 1 drafts)."""

    def __init__(self, target: StagedTarget, state: StepState, rows: int, compile: str | None = None,
                 cuda_graph: bool = False):
        """compile: a torch.compile backend ("inductor"; "aot_eager" traces the same whole graph without generating
        code), None: eager. cuda_graph: on CUDA, the step captured once as a CUDA graph and replayed (elsewhere it
        runs eagerly, the twin the tests check)."""
        self.target, self.state, self.params = target, state, state.params
        self.rows = torch.arange(rows, device=target.device)                           # [r]
        self.run = self.step
        if cuda_graph and target.device.type == "cuda":
            self.graph = None
            self.run = self.replay
        if compile:
            compiled = torch.compile(self.step, fullgraph=True, dynamic=False, backend=compile)

            def run():
                # the suite's own CPU products are an extension call the compiler cannot trace: F.linear inside
                with plain_products(target.model):
                    return compiled()
            self.run = run

    def replay(self) -> torch.Tensor:
        """The step as one CUDA graph: captured on the first call (after warm-up runs on a side stream, which also
        advance the state: the capture's own run is undone by restoring it), then replayed."""
        if self.graph is None:
            device, state = self.target.device, self.state
            saved = (state.tokens.clone(), state.position.clone())
            with torch.cuda.device(device):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        state.tokens.copy_(saved[0])
                        state.position.copy_(saved[1])
                        self.step()
                torch.cuda.current_stream(device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.step()
            state.tokens.copy_(saved[0])    # capturing ran nothing; the warm-ups' writes are undone here
            state.position.copy_(saved[1])
        self.graph.replay()
        return self.state.out

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [r, V] -> the target's token after each row [r]: its argmax (ties to the lowest id, as
        spd.sampling.greedy_token), or the keyed draw argmax(log p + g) over warp's support (KeyedDraws.sample)."""
        if self.params.greedy:
            return logits.argmax(-1)
        probs = torch.stack([warp(row, self.params) for row in logits.unbind(0)]).double()   # [r, V]
        noise = self.state.noise[: len(logits)]                                              # [r, V]
        return torch.where(probs > 0, probs.log() + noise, float("-inf")).argmax(-1)

    def step(self) -> torch.Tensor:
        """One cycle; returns the state's `out`."""
        target, state, r = self.target, self.state, len(self.rows)
        tokens = state.tokens[:r]                                                      # [r]
        positions = state.position + self.rows                                         # [r]
        state.cache.write_at = positions
        try:
            hidden, _ = target.run_layers(target.embed(tokens.view(1, -1)), positions, 0, target.num_layers,
                                          state.cache, frozenset(), state.mask_keys)
        finally:
            state.cache.write_at = None
        logits = target.logits(hidden[0])                                              # [r, V]
        chosen = self.choose(logits)                                                   # [r]
        hit = (tokens[1:] == chosen[:-1]) & (self.rows[1:] <= state.drafts)            # [r-1]
        kept = torch.cumprod(hit.long(), 0).sum()                                      # [] drafts kept
        # the verified tokens are the target's own choices at rows 0..kept: a kept draft equals its row's choice
        top2 = logits.gather(0, kept.view(1, 1).expand(1, logits.shape[-1])).float().topk(2, -1).values   # [1, 2]
        state.out[0] = kept + 1
        state.out[1] = top2[0, 0] - top2[0, 1]
        state.out[2: r + 2] = chosen
        state.position.add_(kept + 1)
        tokens[:1] = chosen.gather(0, kept.view(1))
        return state.out


class DeviceChainDecoder(Decoder):
    """Draft-then-verify through the device step: a context drafter (no target states: the lookup, the priced
    context statistics' chain) drafts up to k tokens on the host from what the cycle read back, and the step over
    the smallest row bucket that holds them verifies them on the device. drafter None: plain AR (k = 0)."""

    def __init__(self, target: StagedTarget, eos_ids: frozenset[int], drafter: ChainDrafter | None = None,
                 k: int = 7, compile: str | None = None, cuda_graphs: bool = False):
        if drafter is not None and drafter.layers_needed():
            raise ValueError(f"{type(drafter).__name__} reads the target's hidden states; the device step hands a "
                             "drafter only the verified tokens and the target's margin")
        self.target, self.eos_ids, self.drafter = target, eos_ids, drafter
        self.k = 0 if drafter is None else min(k, ROWS[-1] - 1)
        self.buckets = sorted(set(r for r in ROWS if r < self.k + 1) | {self.k + 1})
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self.state: StepState | None = None
        self.steps: dict[int, DeviceStep] = {}

    def state_for(self, cache, params: SamplingParams) -> StepState:
        """The shared state over this cache, and its steps (built, and compiled, again only for a new cache
        length bucket or sampling setting)."""
        if self.state is None or self.state.cache is not cache or self.state.params != params:
            self.state = StepState(self.target, cache, self.k + 1, params)
            self.steps = {rows: DeviceStep(self.target, self.state, rows, self.compile, self.cuda_graphs)
                          for rows in self.buckets}
        return self.state

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        target, params, k = self.target, request.params, self.k
        generator = request.generator(target.device)
        # the cache's length in buckets: a step is built (and compiled) once per bucket, not once per prompt
        length = -(-context_length(len(prompt_ids), request.max_new_tokens, k + 1) // BUCKET) * BUCKET
        cache, hidden, _ = prefill(target, prompt_ids, frozenset(), length, self.state and self.state.cache)
        logits = target.logits(hidden[0, -1])                                          # [V]
        draws = None if params.greedy else request.draws(generator, logits.shape[-1])
        state = self.state_for(cache, params)
        state.position.fill_(len(prompt_ids))
        host = torch.zeros(k + 3, dtype=torch.float64, pin_memory=target.device.type == "cuda")
        # the first token from the prefill's last row, by the same rule as every later one
        if draws is not None:
            state.noise[:1].copy_(gumbel(draws, len(prompt_ids), 1))
        state.tokens[:1] = self.steps[1].choose(logits.view(1, -1))
        top2 = logits.float().topk(2).values
        state.out[0], state.out[1], state.out[2] = 1, top2[0] - top2[1], state.tokens[0]
        values = self.read(state, host)
        tokens = list(prompt_ids)
        stats = self.stats = ChainStats(m=k)
        drafts: list[int] = []
        while True:
            count, margin, chosen = int(values[0]), values[1], values[2:]
            for token in chosen[:count]:
                tokens.append(int(token))
                stats.N += 1
                yield tokens[-1]
                if is_final(tokens[-1], stats.N, request.max_new_tokens, self.eos_ids):
                    return
            if self.drafter is not None:
                if stats.N == 1:
                    self.drafter.start({}, tokens)
                    self.drafter.sampling_draws(draws)
                else:
                    self.drafter.verified({}, tokens)
                if self.drafter.uses_margin:
                    self.drafter.target_margin(margin)
            drafts = self.draft(tokens)
            rows = next(r for r in self.buckets if r > len(drafts))
            if drafts:
                state.tokens[1: 1 + len(drafts)] = torch.tensor(drafts)
            state.drafts.fill_(len(drafts))
            if draws is not None:     # the noise is known before the target reads the rows (after the root's position)
                state.noise[:rows].copy_(gumbel(draws, len(tokens), rows))
            self.steps[rows].run()
            values = self.read(state, host)
            stats.cycles += 1
            stats.drafted += len(drafts)
            stats.drafting_cycles += bool(drafts)
            stats.accepted += int(values[0]) - 1
            stats.accepted_per_cycle.append(int(values[0]) - 1)

    def read(self, state: StepState, host: torch.Tensor) -> list[float]:
        """The cycle's one read: the state's `out` copied into the host buffer (pinned on CUDA, non-blocking)."""
        host[: len(state.out)].copy_(state.out, non_blocking=True)
        if host.is_pinned():
            torch.cuda.current_stream(self.target.device).synchronize()
        return host.tolist()

    def draft(self, tokens: list[int]) -> list[int]:
        if self.drafter is None or self.k == 0:
            return []
        return self.drafter.draft_tree(tokens[-1], self.k, 1, self.k, None).tokens()[1:]
