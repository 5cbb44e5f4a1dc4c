"""SPD's pipeline step as one function of device tensors (W = 1): every stage advances its in-flight token one stage
(stage s the token s positions behind the newest, one row each, on its own layers), a device drafter
(spd.drafters.spd_device: the speculation module, from the in-flight tokens' features and its memory of the
positions that left the pipeline) drafts the next token, the
token leaving the last stage gives the target's choice for the next-oldest position, and that choice either keeps
the pipeline (its draft held) or flushes it (the choice enters alone at its position) — all as tensor ops on a
static cache, with the schedule's state (newest position t, occupancy a) in device tensors.

The same schedule as spd.runtime.schedule: a step with a < n tokens in flight is a warm-up (nothing exits), a step
with a = n verifies one token. Stages with nothing to run still run (fixed shapes) on a scratch slot past every
position, which no mask ever shows. A host read a step (the settled token, if any, and the schedule's state) is
the decoder's; nothing inside the step reads a value back.

Drafts are deterministic (the module's argmax, or the context lookup's token), so each is kept exactly when it is
the target's own choice there (greedy: its argmax; sampled: AR's keyed draw at that position): the output is AR's,
token for token."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from spd.decoding import Decoder, Request, context_length, is_final, prefill
from spd.drafters.base import AFTER_STEP, HOST_FRONT, DeviceStepView, Drafter
from spd.drafters.spd_device import SpdDeviceDrafter
from spd.metrics import DecodeStats
from spd.models.module import SpeculationModule
from spd.runtime.device_step import BUCKET, Graphed
from spd.verify.device_sampling import DeviceSampling, choose, gumbel
from spd.verify.accept import kept_drafts
from spd.verify.sampling import SamplingParams
from spd.targets.stages import StagedTarget


class DevicePipelineStep(Graphed):
    def __init__(self, target: StagedTarget, drafter: Drafter, cache, params: SamplingParams,
                 compile: str | None = None, cuda_graph: bool = False):
        """drafter: a PIPELINED DEVICE drafter, bound here to this step's cache. compile: a torch.compile backend,
        None: eager. cuda_graph: on CUDA, the step captured once as a CUDA graph, each stage's rows and the draft on
        streams of their own inside it (fork and join captured), so one replay is one pipeline step; elsewhere the
        same step runs eagerly, stage after stage."""
        device, d, n = target.device, target.config.hidden_size, target.n
        self.target, self.drafter, self.cache, self.n = target, drafter, cache, n
        self.sampling = DeviceSampling(device, params)     # refilled for a new request's settings
        self.layers = drafter.layers_needed(target.bounds)                             # H^l the features read
        self.column = {layer: i for i, layer in enumerate(self.layers)}
        S = cache.max_length
        self.scratch = S - 1                         # where an idle stage writes: past every position
        self.keys = torch.arange(S, device=device).view(1, -1)                         # [1, S]
        self.lags = torch.arange(n, device=device)                                     # [n]
        self.t = torch.zeros((), dtype=torch.long, device=device)                      # [] newest position
        self.a = torch.ones((), dtype=torch.long, device=device)                       # [] occupancy
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)                  # [n] by lag
        self.inputs = torch.zeros(n, d, device=device, dtype=target.dtype)             # [n, d] entering stage s
        self.store = torch.zeros(n, len(self.layers), d, device=device, dtype=target.dtype)   # [n, layers, d]
        # count, margin, token, t, a, held, and the newest token in flight (a host-side front extends its context)
        self.out = torch.zeros(7, dtype=torch.float64, device=device)
        self.key = torch.zeros((), dtype=torch.long, device=device)                    # [] sampling: the request's
        self.vocab = target.model.config.vocab_size
        self.view = DeviceStepView(self.store, self.t, self.a)      # what the drafter reads, the same tensors a step
        drafter.bind(S, n, device, target.dtype)
        on_cuda = cuda_graph and device.type == "cuda"
        # SPD's draft reads only the step's inputs, so it runs beside the stages; a plan that drafts after the
        # step (PPSD, the output states) waits for them
        self.streams = [torch.cuda.Stream(device) for _ in range(n + 1)] if on_cuda else None
        self.choose_runner(on_cuda, compile)

    def mutable(self) -> list[torch.Tensor]:
        return [self.t, self.a, self.tokens, self.inputs, self.store] + self.drafter.mutable()

    def out_buffer(self) -> torch.Tensor:
        return self.out

    def on(self, lane: int):
        """Lane `lane`'s stream (stage s: lane s, the draft: lane n) where the step runs on streams."""
        return nullcontext() if self.streams is None else torch.cuda.stream(self.streams[lane])

    def start(self, prompt_ids: list[int], captured: dict[int, torch.Tensor], first: torch.Tensor) -> None:
        """A request's prompt (its captured states {layer: [1, P, d]} to the drafter), and the first token [1] in
        flight alone."""
        self.drafter.start(captured, list(prompt_ids) + [int(first[0])])
        self.t.fill_(len(prompt_ids))
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
        if self.streams is not None and self.drafter.has(AFTER_STEP):
            for stream in self.streams[:n]:
                self.streams[n].wait_stream(stream)
        with self.on(n):
            draft = self.drafter.propose(self.view)                                    # [1]
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
        self.drafter.observe(self.store, exit_at)
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

    def __init__(self, target: StagedTarget, drafter: Drafter | SpeculationModule, eos_ids: frozenset[int],
                 compile: str | None = None, cuda_graphs: bool = False, lookup: tuple[int, int] | None = None):
        """drafter: a PIPELINED DEVICE drafter (spd.methods names the method's: spd.drafters.spd_device). A bare
        module is SPD's device drafter over it, with the context lookup's (min_n, max_n) in front where `lookup`
        is given (the benchmarks' rows, bench/gpu.py, build it so)."""
        if isinstance(drafter, SpeculationModule):
            drafter = SpdDeviceDrafter(drafter, lookup)
        if target.bounds != drafter.module.bounds:
            raise ValueError(f"the module is for stage bounds {drafter.module.bounds}, the target runs "
                             f"{target.bounds}")
        self.target, self.drafter, self.eos_ids, self.compile = target, drafter, eos_ids, compile
        self.cuda_graphs = cuda_graphs
        # the host's draft in front of the device's (the context lookup), read back each step
        self.front = drafter if drafter.has(HOST_FRONT) else None
        self.step: DevicePipelineStep | None = None

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        target, params, n, front = self.target, request.params, self.target.n, self.front
        generator = request.generator(target.device)
        # + 1: the scratch slot idle stages write
        length = -(-(context_length(len(prompt_ids), request.max_new_tokens, n + 1) + 1) // BUCKET) * BUCKET
        capture = frozenset(self.drafter.layers_needed(target.bounds))
        cache, hidden, captured = prefill(target, prompt_ids, capture, length,
                                          self.step and self.step.cache)
        logits = target.logits(hidden[0, -1])                                          # [V]
        draws = None if params.greedy else request.draws(generator, logits.shape[-1])
        if self.step is not None and self.step.cache is cache and self.step.sampling.greedy == params.greedy:
            self.step.sampling.set(params)       # the built (compiled, captured) step serves the new settings
        else:
            self.step = DevicePipelineStep(target, self.drafter, cache, params, self.compile, self.cuda_graphs)
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
        drafted_by: dict[int, str] = {}           # position -> the source of its draft (lookup or module)
        stats.N = 1
        yield token
        if is_final(token, stats.N, request.max_new_tokens, self.eos_ids):
            return
        while True:
            if front is not None:
                drafted_by[t + 1] = front.front(t)
            settles = t - n + 2                   # the position a verdict of this step is on
            step.run()
            host.copy_(step.out, non_blocking=True)
            if host.is_pinned():
                torch.cuda.current_stream(target.device).synchronize()
            count, _, token, t_next, a_next, held, newest = host.tolist()
            stats.K += 1
            t, a = int(t_next), int(a_next)
            if front is not None:                 # a flush takes the drafts back; the newest token joins
                front.read_back(t, int(newest))
            if count:
                # one more token: the held draft, or the correction
                stats.settle(bool(held), drafted_by.pop(settles, "module"))
                yield int(token)
                if is_final(int(token), stats.N, request.max_new_tokens, self.eos_ids):
                    stats.finish()
                    return
