"""How the benchmarks (bench/clock.py, bench/pipeline_rivals.py) sample and seed a prompt, total a row over its
prompts, and how the rows of one field take turns on each prompt so that a machine whose speed drifts is shared by all
of them."""

from __future__ import annotations

import time
import zlib

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from spd.decoding import GenerationResult
from spd.verify.sampling import SamplingParams
from spd.targets.linears import plain_products


def params_for(temperature: float) -> SamplingParams:
    """How every row samples at `temperature` (T = 0: greedy; T > 0: top-k 50, top-p 1)."""
    return SamplingParams() if temperature == 0 else SamplingParams(temperature=temperature, top_k=50, top_p=1.0)


class FirstToken(BaseStreamer):
    """A streamer that only notes when `generate` hands over its first new token (its first put is the prompt)."""

    def __init__(self):
        self.start, self.puts, self.seconds = time.perf_counter(), 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def hf_run(model, pad_id: int, temperature: float, max_new_tokens: int, lookup: int | None = None):
    """run(key, ids) -> GenerationResult with transformers `generate` as a user has it: SDPA attention and its own
    products whatever the suite set, sampled as params_for(temperature) samples, seeded per prompt; lookup: its
    prompt-lookup decoding (`prompt_lookup_num_tokens`)."""
    def run(key, ids):
        torch.manual_seed(seed_of(key))
        sample = dict(do_sample=True, temperature=temperature, top_k=50, top_p=1.0) if temperature else \
            dict(do_sample=False)
        if lookup:
            sample["prompt_lookup_num_tokens"] = lookup
        kernel, model.config._attn_implementation = model.config._attn_implementation, "sdpa"
        try:
            first = FirstToken()
            with plain_products(model):
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                                     streamer=first, **sample)
            return GenerationResult(out[0, len(ids):].tolist(), time.perf_counter() - first.start,
                                    first_seconds=first.seconds)
        finally:
            model.config._attn_implementation = kernel
    return run


def seed_of(key: str) -> int:
    """One seed per prompt, the same for every row: sampled rows of a cell draw from the same seeds."""
    return zlib.crc32(key.encode())


class Tally:
    """One row's totals over its prompts: pooled tokens/s, each prompt's tokens/s, each source's acceptance, and
    L′acc (or τ for a chain) where there are steps. `outputs` ({prompt key: token ids}) lets main() check every
    greedy row against the suite's AR."""

    def __init__(self):
        self.tokens = self.seconds = self.N = self.K = self.cycles = self.drafted = 0
        self.outputs, self.sources, self.per_prompt = {}, {}, {}

    def add(self, key: str, result) -> None:
        self.outputs[key] = result.token_ids
        self.per_prompt[key] = len(result.token_ids) / result.seconds
        stats = result.stats
        self.drafted += getattr(stats, "drafted", 0)
        for source, (verified, accepted) in (stats.sources.items() if stats else ()):
            total = self.sources.setdefault(source, [0, 0])
            total[0], total[1] = total[0] + verified, total[1] + accepted
        self.tokens += len(result.token_ids)
        self.seconds += result.seconds
        if hasattr(stats, "cycles"):    # a chain: tau = tokens after the first per target forward
            self.N, self.cycles = self.N + stats.N - 1, self.cycles + stats.cycles
        elif stats is not None:
            self.N, self.K = self.N + stats.N, self.K + stats.K

    def summary(self) -> dict:
        out = {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens / self.seconds,
               "outputs": self.outputs, "per_prompt_tokens_per_s": self.per_prompt,
               "sources": {source: {"verified": v, "accepted": a, "acceptance": a / v}
                           for source, (v, a) in self.sources.items()}}
        if self.K:
            out.update(N=self.N, K=self.K, alpha=self.N / self.K)
        if self.cycles:
            out.update(cycles=self.cycles, tau=self.N / self.cycles, rows_per_cycle=1 + self.drafted / self.cycles)
        return out


def decode_interleaved(prompts, runs: list) -> list[dict]:
    """Every run(key, ids) on each prompt before the next prompt, the order rotated one place per prompt: the
    machine's speed drifts over minutes (on one machine the same AR row measured 20.7 and 28 tokens/s two hours
    apart), and a row timed over all prompts after another meets another machine than its neighbour; taking turns
    per prompt, every row meets the same moments. Returns each run's Tally summary, in the order given."""
    tallies = [Tally() for _ in runs]
    for i, (key, ids) in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        for j in rotated(list(range(len(runs))), i):
            tallies[j].add(key, runs[j](key, ids))
    return [tally.summary() for tally in tallies]


def rotated(rows: list, i: int) -> list:
    """The order the rows take their turns on the i-th prompt: rotated one place per prompt."""
    return rows[i % len(rows):] + rows[: i % len(rows)]


def decode_all(prompts, run) -> dict:
    """run(key, ids) -> GenerationResult over every prompt: one row alone."""
    return decode_interleaved(prompts, [run])[0]
