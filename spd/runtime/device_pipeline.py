"""SPD's pipeline step as one function of device tensors (W = 1): every stage advances its in-flight token one stage
(stage s the token s positions behind the newest, one row each, on its own layers), the speculation module drafts
the next token from the in-flight tokens' features and its memory of the positions that left the pipeline, the
token leaving the last stage gives the target's choice for the next-oldest position, and that choice either keeps
the pipeline (its draft held) or flushes it (the choice enters alone at its position) — all as tensor ops on a
static cache, with the schedule's state (newest position t, occupancy a) in device tensors.

The same schedule as spd.runtime.schedule: a step with a < n tokens in flight is a warm-up (nothing exits), a step
with a = n verifies one token. Stages with nothing to run still run (fixed shapes) on a scratch slot past every
position, which no mask ever shows. A host read a step (the settled token, if any, and the schedule's state) is
the decoder's; nothing inside the step reads a value back.

Drafts are the module's argmax, deterministic, so each is kept exactly when it is the target's own choice there
(greedy: its argmax; sampled: AR's keyed draw at that position): the output is AR's, token for token."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from spd.models.attention import layer_forward, memory_kv
from spd.decoding import Decoder, Request, context_length, is_final, prefill
from spd.drafters.lookup import NgramIndex
from spd.metrics import DecodeStats
from spd.models.module import SpeculationModule
from spd.runtime.device_step import BUCKET, Graphed
from spd.verify.device_sampling import DeviceSampling, choose, gumbel
from spd.verify.accept import kept_drafts
from spd.verify.sampling import SamplingParams
from spd.targets.stages import StagedTarget


class DevicePipelineStep(Graphed):
    def __init__(self, target: StagedTarget, module: SpeculationModule, cache, params: SamplingParams,
                 compile: str | None = None, cuda_graph: bool = False):
        """compile: a torch.compile backend, None: eager. cuda_graph: on CUDA, the step captured once as a CUDA
        graph, each stage's rows and the module's draft on streams of their own inside it (fork and join
        captured), so one replay is one pipeline step; elsewhere the same step runs eagerly, stage after stage."""
        if target.bounds != module.bounds:
            raise ValueError(f"the module is for stage bounds {module.bounds}, the target runs {target.bounds}")
        device, d, n = target.device, target.config.hidden_size, target.n
        self.target, self.module, self.cache, self.n = target, module, cache, n
        self.sampling = DeviceSampling(device, params)     # refilled for a new request's settings
        self.plan = module.plan
        self.layers = module.plan.needed_layers(target.bounds)                         # H^l the features read
        self.column = {layer: i for i, layer in enumerate(self.layers)}
        # the depth each lag's feature is read at when the pipeline is full (only validity changes with a)
        self.depths = [self.plan.depth(n - 1, n - 1 - j, n, n) for j in range(n)]     # lag j -> depth k
        self.memory_depth = self.plan.memory_depth(n)
        S = cache.max_length
        self.scratch = S - 1                         # where an idle stage writes: past every position
        self.keys = torch.arange(S, device=device).view(1, -1)                         # [1, S]
        self.lags = torch.arange(n, device=device)                                     # [n]
        self.t = torch.zeros((), dtype=torch.long, device=device)                      # [] newest position
        self.a = torch.ones((), dtype=torch.long, device=device)                       # [] occupancy
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)                  # [n] by lag
        self.inputs = torch.zeros(n, d, device=device, dtype=target.dtype)             # [n, d] entering stage s
        self.store = torch.zeros(n, len(self.layers), d, device=device, dtype=target.dtype)   # [n, layers, d]
        # count, margin, token, t, a, held, and the newest token in flight (a host-side lookup extends its context)
        self.out = torch.zeros(7, dtype=torch.float64, device=device)
        # draft_source=lookup+module: the context lookup's draft for the next position, where it found one (the
        # decoder writes both before the step)
        self.lookup = torch.zeros(1, dtype=torch.long, device=device)                 # [1]
        self.looked = torch.zeros((), dtype=torch.bool, device=device)                 # []
        self.key = torch.zeros((), dtype=torch.long, device=device)                    # [] sampling: the request's
        self.vocab = target.model.config.vocab_size
        attn = module.layers[0].self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        # per layer K, V [1, H, S + n - 1, hd]: the memory's S positions, then the n - 1 lag rows' slots, which every
        # draft rewrites in place (concatenating them would copy the whole memory each step)
        self.memory = [(torch.zeros(1, kv_heads, S + n - 1, attn.head_dim, device=device, dtype=target.dtype),
                        torch.zeros(1, kv_heads, S + n - 1, attn.head_dim, device=device, dtype=target.dtype))
                       for _ in module.layers]
        on_cuda = cuda_graph and device.type == "cuda"
        # SPD's draft reads only the step's inputs, so it runs beside the stages; a plan that drafts after the
        # step (PPSD, the output states) waits for them
        self.streams = [torch.cuda.Stream(device) for _ in range(n + 1)] if on_cuda else None
        self.choose_runner(on_cuda, compile)

    def mutable(self) -> list[torch.Tensor]:
        return [self.t, self.a, self.tokens, self.inputs, self.store]

    def out_buffer(self) -> torch.Tensor:
        return self.out

    def on(self, lane: int):
        """Lane `lane`'s stream (stage s: lane s, the draft: lane n) where the step runs on streams."""
        return nullcontext() if self.streams is None else torch.cuda.stream(self.streams[lane])

    def start(self, prompt_ids: list[int], captured: dict[int, torch.Tensor], first: torch.Tensor) -> None:
        """The prompt's memory rows (captured {layer: [1, P, d]}), and the first token [1] in flight alone."""
        P = len(prompt_ids)
        rows = self.module.feature(self.memory_depth, captured)                        # [1, P, d]
        self.write_memory(rows, torch.arange(P, device=rows.device))
        self.t.fill_(P)
        self.a.fill_(1)
        self.enter(first)

    def enter(self, token: torch.Tensor) -> None:
        """token [1] enters stage 1 at lag 0: its embedding is its stage input and its H^0."""
        h0 = self.target.embed(token.view(1, 1))[0, 0]                                 # [d]
        self.tokens[:1] = token
        self.entered(h0)

    def entered(self, h0: torch.Tensor) -> None:
        """The newest token's embedding h0 [d]: stage 1's input, and its H^0 where a feature reads it."""
        self.inputs[0] = h0
        if 0 in self.column:
            self.store[0, self.column[0]] = h0

    def write_memory(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Memory rows [1, r, d] at positions [r]: their K/V in the module's static cache."""
        cos, sin = self.module.rope(positions.view(1, -1), rows)
        for layer, (keys, values) in zip(self.module.layers, self.memory):
            k, v = memory_kv(layer, rows, cos, sin)
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)

    def feature(self, depth: int, lag: int) -> torch.Tensor:
        """g^depth [1, 1, d] of the token at `lag` from its stored states."""
        return self.module.feature(depth, {l: self.store[lag, self.column[l]].view(1, 1, -1)
                                           for l in self.module.feature_layers[depth]})

    def draft(self) -> torch.Tensor:
        """The module's token [1] for position t + 1 from G_t: memory rows before the in-flight tokens, each
        in-flight token's feature at its depth, the newest's as the query."""
        module, n = self.module, self.n
        query = self.feature(self.depths[0], 0)                                        # [1, 1, d]
        at = self.t.view(1, 1)
        cos, sin = module.rope(at, query)
        rows = torch.cat([self.feature(self.depths[j], j) for j in range(1, n)], 1) if n > 1 else None   # [1, n-1, d]
        lag_positions = (self.t - self.lags[1:]).clamp(min=0).view(1, -1)              # [1, n-1]
        visible = torch.cat([self.keys < self.t - self.a + 1,                          # [1, S + n - 1]: memory,
                             (self.lags[1:] < self.a).view(1, -1)], 1)                 # then the lags in flight
        if rows is not None:
            rcos, rsin = module.rope(lag_positions, rows)
        hidden = query
        for layer, (keys, values) in zip(module.layers, self.memory):
            if rows is not None:        # the last n - 1 slots
                keys[:, :, 1 - n:], values[:, :, 1 - n:] = memory_kv(layer, rows, rcos, rsin)
            hidden = layer_forward(layer, hidden, cos, sin, keys, values, visible.view(1, 1, -1))
        return module.target_logits(module.head(module.norm(hidden))[0, -1]).argmax().view(1)   # [1]

    def advance(self, s: int, where: torch.Tensor) -> torch.Tensor:
        """Stage s over its in-flight token's row at position `where` [1] (the scratch slot when idle); its
        captured states join the token's store. Returns the stage's output [d]."""
        target, bounds = self.target, self.target.bounds
        self.cache.write_at = where
        try:
            capture = frozenset(l for l in self.layers if bounds[s] < l <= bounds[s + 1])
            hidden, captured = target.run_layers(self.inputs[s].view(1, 1, -1), where, bounds[s], bounds[s + 1],
                                                 self.cache, capture, self.keys)
        finally:
            self.cache.write_at = None
        for layer, h in captured.items():
            self.store[s, self.column[layer]] = h[0, 0]
        return hidden[0, 0]

    @staticmethod
    def settle(logits: torch.Tensor, chosen: torch.Tensor, candidate: torch.Tensor):
        """The verdict on the candidate draft [1]: (held [], the settled token [1]) — spd.verify.accept's rule, kept
        exactly when it is the target's own choice there (its argmax, or AR's keyed draw)."""
        return kept_drafts(candidate, chosen) == 1, chosen

    def step(self) -> torch.Tensor:
        target, n = self.target, self.n
        valid = self.lags < self.a                                                     # [n] stages with work
        positions = torch.where(valid, self.t - self.lags, self.scratch)               # [n]
        if self.streams is not None:        # fork: every lane starts after what the step's inputs came from
            main = torch.cuda.current_stream(self.target.device)
            for stream in self.streams:
                stream.wait_stream(main)
        outputs = []
        for s in range(n):
            with self.on(s):
                outputs.append(self.advance(s, positions[s: s + 1]))
        if self.streams is not None and self.plan.after_step:
            for stream in self.streams[:n]:
                self.streams[n].wait_stream(stream)
        with self.on(n):
            draft = torch.where(self.looked, self.lookup, self.draft())                # [1]
        if self.streams is not None:        # join
            for stream in self.streams:
                main.wait_stream(stream)
        # the token leaving the last stage (a = n) gives the target's choice for the next-oldest position
        logits = target.logits(outputs[-1].view(1, -1))                                # [1, V]
        # sampled: the keyed noise of the position the exiting token chooses, the next-oldest's (computed here, so
        # nothing is copied in a step; where nothing exits it goes unused)
        noise = None if self.sampling.greedy else gumbel(self.key, (self.t - n + 2).view(1), self.vocab)   # [1, V]
        chosen = choose(logits, self.sampling, noise)                                  # [1]
        exiting = self.a == n                                                          # []
        candidate = self.tokens[n - 2: n - 1] if n > 1 else draft                      # [1]
        held, chosen = self.settle(logits, chosen, candidate)                          # [], [1]
        held = exiting & held
        flush = exiting & ~held
        top2 = logits.float().topk(2, -1).values                                       # [1, 2]
        self.out[0] = exiting.double()
        self.out[1] = top2[0, 0] - top2[0, 1]
        self.out[2] = chosen[0].double()
        # the exiting position is verified: its memory row (written where it is, or on the scratch slot)
        exit_at = torch.where(exiting, self.t - n + 1, self.scratch).view(1)           # [1]
        memory_row = self.feature(self.memory_depth, n - 1)                            # [1, 1, d]
        self.write_memory(memory_row, exit_at)
        # advance: every token one stage deeper and the draft enters, or the choice enters alone after a flush
        shifted = torch.cat([draft, self.tokens[:-1]])                                 # [n]
        self.tokens.copy_(torch.where(flush, chosen.expand(n), shifted))
        if n > 1:
            self.inputs[1:] = torch.stack(outputs[:-1])
        self.store[1:] = self.store[:-1].clone()
        self.t.copy_(torch.where(flush, self.t - n + 2, self.t + 1))
        self.a.copy_(torch.where(flush, 1, (self.a + 1).clamp(max=n)))
        self.entered(target.embed(self.tokens[:1].view(1, 1))[0, 0])
        self.out[3] = self.t.double()
        self.out[4] = self.a.double()
        self.out[5] = held.double()
        self.out[6] = self.tokens[0].double()
        return self.out


class DevicePipelineDecoder(Decoder):
    """SPD's pipeline through the device step: one step, one read of its buffer (a settled token or none)."""

    def __init__(self, target: StagedTarget, module: SpeculationModule, eos_ids: frozenset[int],
                 compile: str | None = None, cuda_graphs: bool = False, lookup: tuple[int, int] | None = None):
        """lookup: (min_n, max_n) for draft_source=lookup+module — the context lookup's token where the context's
        suffix matched earlier, else the module's (spd.drafters.hybrid.LookupThenModule's rule), looked up on the
        host from the buffer each step returns and handed to the next step."""
        self.target, self.module, self.eos_ids, self.compile = target, module, eos_ids, compile
        self.cuda_graphs, self.lookup = cuda_graphs, lookup
        self.step: DevicePipelineStep | None = None

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        target, params, n = self.target, request.params, self.target.n
        generator = request.generator(target.device)
        # + 1: the scratch slot idle stages write
        length = -(-(context_length(len(prompt_ids), request.max_new_tokens, n + 1) + 1) // BUCKET) * BUCKET
        capture = frozenset(self.module.plan.needed_layers(target.bounds))
        cache, hidden, captured = prefill(target, prompt_ids, capture, length,
                                          self.step and self.step.cache)
        logits = target.logits(hidden[0, -1])                                          # [V]
        draws = None if params.greedy else request.draws(generator, logits.shape[-1])
        if self.step is not None and self.step.cache is cache and self.step.sampling.greedy == params.greedy:
            self.step.sampling.set(params)       # the built (compiled, captured) step serves the new settings
        else:
            self.step = DevicePipelineStep(target, self.module, cache, params, self.compile, self.cuda_graphs)
        step = self.step
        noise = None
        if draws is not None:
            step.key.fill_(draws.key)
            noise = gumbel(step.key, torch.tensor([len(prompt_ids)], device=target.device), step.vocab)   # [1, V]
        first = choose(logits.view(1, -1), params, noise)                              # [1]
        step.start(prompt_ids, captured, first)
        stats = self.stats = DecodeStats(n=n)
        host = torch.zeros(7, dtype=torch.float64, pin_memory=target.device.type == "cuda")
        token, t, a = int(first[0]), len(prompt_ids), 1
        index = NgramIndex(*self.lookup) if self.lookup else None    # every position up to the newest in flight
        drafted_by: dict[int, str] = {}           # position -> the source of its draft (lookup or module)
        if index is not None:
            index.extend(list(prompt_ids) + [token])
        stats.N = 1
        yield token
        if is_final(token, stats.N, request.max_new_tokens, self.eos_ids):
            return
        while True:
            if index is not None:
                matched, start = index.match()
                step.looked.fill_(bool(matched))
                if matched:
                    step.lookup.fill_(index.continuation(start, 1)[0])
                drafted_by[t + 1] = "lookup" if matched else "module"
            settles = t - n + 2                   # the position a verdict of this step is on
            step.run()
            host.copy_(step.out, non_blocking=True)
            if host.is_pinned():
                torch.cuda.current_stream(target.device).synchronize()
            count, _, token, t_next, a_next, held, newest = host.tolist()
            stats.K += 1
            t, a = int(t_next), int(a_next)
            if index is not None:                 # a flush takes the drafts back; the newest token joins
                index.truncate(t)
                index.extend([int(newest)])
            if count:
                # one more token: the held draft, or the correction
                stats.settle(bool(held), drafted_by.pop(settles, "module"))
                yield int(token)
                if is_final(int(token), stats.N, request.max_new_tokens, self.eos_ids):
                    stats.finish()
                    return
