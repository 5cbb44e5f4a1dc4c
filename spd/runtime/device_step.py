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
from spd.targets.linears import plain_products
from spd.targets.stages import StagedTarget


BUCKET = 512     # positions: a static cache's length is a multiple of this


class DeviceStep:
    """One cycle over k + 1 rows, its state in device tensors: `tokens` [k+1] (the root, then its drafts),
    `drafts` [] (how many of tokens[1:] are real; the rest are padding that is never kept), `position` [] (the
    root's position), `noise` [k+1, V] (sampling: the Gumbel noise of the positions the rows choose)."""

    def __init__(self, target: StagedTarget, cache, k: int, params: SamplingParams, compile: str | None = None):
        """compile: a torch.compile backend ("inductor"; "aot_eager" traces the same whole graph without generating
        code), None: eager."""
        if not cache.static:
            raise ValueError("a device step needs a static cache (new_cache(max_length=...))")
        device = target.device
        self.target, self.cache, self.k, self.params = target, cache, k, params
        self.rows = torch.arange(k + 1, device=device)                                # [k+1]
        self.tokens = torch.zeros(k + 1, dtype=torch.long, device=device)             # [k+1]
        self.drafts = torch.zeros((), dtype=torch.long, device=device)                # []
        self.position = torch.zeros((), dtype=torch.long, device=device)              # []
        self.out = torch.zeros(k + 2, dtype=torch.long, device=device)                # [k+2] count, tokens
        self.mask_keys = torch.arange(cache.max_length, device=device).view(1, -1)    # [1, S]
        vocab = target.model.config.vocab_size
        self.noise = None if params.greedy else \
            torch.zeros(k + 1, vocab, dtype=torch.float64, device=device)           # [k+1, V]
        self.run = self.step
        if compile:
            compiled = torch.compile(self.step, fullgraph=True, dynamic=False, backend=compile)

            def run():
                # the suite's own CPU products are an extension call the compiler cannot trace: F.linear inside
                with plain_products(target.model):
                    return compiled()
            self.run = run

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [k+1, V] -> the target's token after each row [k+1]: its argmax (ties to the lowest id, as
        spd.sampling.greedy_token), or the keyed draw argmax(log p + g) over warp's support (KeyedDraws.sample)."""
        if self.params.greedy:
            return logits.argmax(-1)
        probs = torch.stack([warp(row, self.params) for row in logits.unbind(0)]).double()   # [k+1, V]
        scores = torch.where(probs > 0, probs.log() + self.noise, float("-inf"))
        return scores.argmax(-1)

    def step(self) -> torch.Tensor:
        """One cycle; returns `out` [k+2]: the count c of verified tokens, then the tokens (the first c are real)."""
        target = self.target
        positions = self.position + self.rows                                         # [k+1]
        self.cache.write_at = positions
        try:
            hidden, _ = target.run_layers(target.embed(self.tokens.view(1, -1)), positions, 0, target.num_layers,
                                          self.cache, frozenset(), self.mask_keys)
        finally:
            self.cache.write_at = None
        chosen = self.choose(target.logits(hidden[0]))                                # [k+1]
        hit = (self.tokens[1:] == chosen[:-1]) & (self.rows[1:] <= self.drafts)       # [k]
        kept = torch.cumprod(hit.long(), 0).sum()                                     # [] drafts kept
        # the verified tokens are the target's own choices at rows 0..kept: a kept draft equals its row's choice
        self.out[0] = kept + 1
        self.out[1:] = chosen
        self.position.add_(kept + 1)
        self.tokens[:1] = chosen.gather(0, kept.view(1))
        return self.out


class DeviceChainDecoder(Decoder):
    """Draft-then-verify through the device step: a context drafter (no target states, no margin: the lookup)
    drafts up to k tokens on the host from the tokens read back, the step verifies them on the device. drafter
    None: plain AR (k = 0)."""

    def __init__(self, target: StagedTarget, eos_ids: frozenset[int], drafter: ChainDrafter | None = None,
                 k: int = 7, compile: str | None = None):
        if drafter is not None and (drafter.layers_needed() or drafter.uses_margin):
            raise ValueError(f"{type(drafter).__name__} reads the target's states or margin; the device step hands "
                             "a drafter only the verified tokens")
        self.target, self.eos_ids, self.drafter = target, eos_ids, drafter
        self.k = 0 if drafter is None else k
        self.compile = compile
        self._steps: dict[tuple, DeviceStep] = {}

    def device_step(self, cache, params: SamplingParams) -> DeviceStep:
        """The step over this cache (a fresh cache length: a new step, compiled again when compiling)."""
        key = (cache.max_length, params)
        step = self._steps.get(key)
        if step is None or step.cache is not cache:
            step = self._steps[key] = DeviceStep(self.target, cache, self.k, params, self.compile)
        return step

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        target, params, k = self.target, request.params, self.k
        generator = request.generator(target.device)
        # the cache's length in buckets: a step is built (and compiled) once per bucket, not once per prompt
        length = -(-context_length(len(prompt_ids), request.max_new_tokens, k + 1) // BUCKET) * BUCKET
        cached = next(iter(self._steps.values())).cache if self._steps else None
        cache, hidden, _ = prefill(target, prompt_ids, frozenset(), length, cached)
        logits = target.logits(hidden[0, -1])
        draws = None if params.greedy else request.draws(generator, logits.shape[-1])
        step = self.device_step(cache, params)
        step.position.fill_(len(prompt_ids))
        host = torch.zeros(k + 2, dtype=torch.long, pin_memory=target.device.type == "cuda")
        # the first token from the prefill's last row, by the same rule as every later one
        if draws is not None:
            step.noise[0] = -torch.log(-torch.log(draws.uniforms(len(prompt_ids))))
        step.tokens[:1] = step.choose(logits.view(1, -1))[:1]
        host[:1].copy_(step.tokens[:1], non_blocking=True)
        self.synchronize(host)
        first = host.tolist()[0]
        tokens = list(prompt_ids) + [first]
        produced = 1
        stats = self.stats = ChainStats(m=k, N=1)
        yield first
        if is_final(first, produced, request.max_new_tokens, self.eos_ids):
            return
        if self.drafter is not None:
            self.drafter.start({}, tokens)
            self.drafter.sampling_draws(draws)
        while True:
            drafts = self.draft(tokens)
            root = len(tokens) - 1                    # the newest verified token's position
            if drafts:
                step.tokens[1: 1 + len(drafts)] = torch.tensor(drafts)
            step.drafts.fill_(len(drafts))
            if draws is not None:                      # the noise is known before the target reads the rows
                step.noise.copy_(-torch.log(-torch.log(torch.stack(
                    [draws.uniforms(root + 1 + j) for j in range(k + 1)]))))
            host.copy_(step.run(), non_blocking=True)  # the cycle's one read
            self.synchronize(host)
            count, *chosen = host.tolist()
            stats.cycles += 1
            stats.drafted += len(drafts)
            stats.drafting_cycles += bool(drafts)
            stats.accepted += count - 1
            stats.accepted_per_cycle.append(count - 1)
            for token in chosen[:count]:
                tokens.append(token)
                produced += 1
                stats.N = produced
                yield token
                if is_final(token, produced, request.max_new_tokens, self.eos_ids):
                    return
            if self.drafter is not None:
                self.drafter.verified({}, tokens)

    def synchronize(self, host: torch.Tensor) -> None:
        if host.is_pinned():                           # the copy was issued non-blocking on the device's stream
            torch.cuda.current_stream(self.target.device).synchronize()

    def draft(self, tokens: list[int]) -> list[int]:
        if self.drafter is None:
            return []
        tree = self.drafter.draft_tree(tokens[-1], self.k, 1, self.k, None)
        return tree.tokens()[1:]
