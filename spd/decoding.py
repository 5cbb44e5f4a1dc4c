"""What every decoding method shares: the request, the decoder's one shape (a stream of verified tokens), the
prefill, the stop rule, and the result record."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator

import torch

from spd.metrics import ChainStats, DecodeStats
from spd.verify.sampling import KeyedDraws, SamplingParams
from spd.targets.kv_cache import LayerKVCache
from spd.targets.linear_states import ROLLBACK
from spd.targets.stages import StagedTarget


@dataclass(frozen=True)
class Request:
    """One decode: how many tokens at most, how to sample them, and from which seed. Stop strings are text and
    belong to whoever detokenizes (spd.engine); a decoder stops at max_new_tokens or an end-of-sequence token."""
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None            # None: a fresh seed from the OS (greedy ignores it)

    def draws(self, generator: torch.Generator, vocab: int) -> KeyedDraws | None:
        """A sampled request's keyed draws (its generator's first draw is their key); None when greedy."""
        return None if self.params.greedy else KeyedDraws.of(generator, vocab)

    def generator(self, device) -> torch.Generator:
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


@dataclass
class GenerationResult:
    token_ids: list[int]               # the N generated tokens
    seconds: float                     # prefill + decode wall time: the call to the last token
    stats: DecodeStats | ChainStats | None = None   # None for plain autoregressive decoding
    first_seconds: float | None = None  # the call to the first token (the prefill's share)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def decode_seconds(self) -> float | None:
        """The first token to the last: the time the tokens after the first took."""
        return None if self.first_seconds is None else self.seconds - self.first_seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the first token to the last (the rate a prompt's length does not set)."""
        d = self.decode_seconds
        return None if d is None or len(self.token_ids) < 2 else (len(self.token_ids) - 1) / d if d > 0 else None


class Decoder(ABC):
    """Every decoding method's one shape: `stream` yields each token as it is verified (nanochat's
    `Engine.generate`). Closing the stream early cancels the decode at the token it stopped at, and the decoder
    (its executor, its caches) is ready for the next request. `stats` is the current or last decode's record."""

    stats: DecodeStats | ChainStats | None = None

    @abstractmethod
    def stream(self, prompt_ids: list[int], request: Request) -> Iterator[int]:
        ...

    def generate(self, prompt_ids: list[int], request: Request, on_token=None) -> GenerationResult:
        """The whole stream at once; on_token(token_id) sees each token as it comes."""
        start = time.perf_counter()
        tokens, first = [], None
        for token in self.stream(prompt_ids, request):
            if first is None:
                first = time.perf_counter() - start
            tokens.append(token)
            if on_token:
                on_token(token)
        return GenerationResult(tokens, time.perf_counter() - start, self.stats, first)


def prefill(target: StagedTarget, prompt_ids: list[int], capture=frozenset(), max_length: int | None = None,
            cache: LayerKVCache | None = None, rollback: int = ROLLBACK):
    """All layers over the prompt in one batched pass into a fresh cache (static when max_length is given), or into
    `cache` emptied, when that static cache is long enough (its buffers, and graphs captured on them, stay valid).
    rollback: positions a hybrid's linear-attention layers keep (a step's rows, at least).
    Returns (cache, H^L [1, P, d], {l: H^l [1, P, d]})."""
    if cache is not None and cache.static and max_length is not None and cache.max_length >= max_length \
            and cache.linear.slots > rollback:
        cache.crop(0)
    else:
        cache = target.new_cache(max_length, rollback)
    ids = torch.tensor([prompt_ids], device=target.device)
    hidden, captured = target.forward_all(ids, cache, 0, capture)
    return cache, hidden, captured


def context_length(prompt_len: int, max_new_tokens: int, ahead: int) -> int:
    """Positions a decode can write: the prompt, the new tokens, and `ahead` more that a pipeline or a chain may
    feed past the last settled token before its verification stops the run."""
    return prompt_len + max_new_tokens + ahead


def is_final(token: int, produced: int, max_new_tokens: int, eos_ids: frozenset[int]) -> bool:
    return token in eos_ids or produced >= max_new_tokens


def eos_ids_of(model_config, tokenizer=None) -> frozenset[int]:
    ids = set()
    for source in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)

