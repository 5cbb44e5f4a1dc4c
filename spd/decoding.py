"""What every decoding method shares: the prefill, the stop rule, and the result record."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spd.metrics import DecodeStats
from spd.target.kv_cache import LayerKVCache
from spd.target.stages import StagedTarget


@dataclass
class GenerationResult:
    token_ids: list[int]               # the N generated tokens
    seconds: float                     # prefill + decode wall time
    stats: DecodeStats | None = None   # None for plain autoregressive decoding

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")


def prefill(target: StagedTarget, prompt_ids: list[int], capture=frozenset(), max_length: int | None = None,
            cache: LayerKVCache | None = None):
    """All layers over the prompt in one batched pass into a fresh cache (static when max_length is given), or into
    `cache` emptied, when that static cache is long enough (its buffers, and graphs captured on them, stay valid).
    Returns (cache, H^L [1, P, d], {l: H^l [1, P, d]})."""
    if cache is not None and cache.static and max_length is not None and cache.max_length >= max_length:
        cache.crop(0)
    else:
        cache = target.new_cache(max_length)
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

