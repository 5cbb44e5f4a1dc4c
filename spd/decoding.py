"""What every decoding method shares: the prefill, the stop rule, and the result record."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spd.metrics import DecodeStats
from spd.target.stages import StagedTarget


@dataclass
class GenerationResult:
    token_ids: list[int]               # the N generated tokens
    seconds: float                     # prefill + decode wall time
    stats: DecodeStats | None = None   # None for plain autoregressive decoding
    trace: list[dict] = field(default_factory=list)  # per-step records when tracing is on (tests, analysis)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")


def prefill(target: StagedTarget, prompt_ids: list[int], capture=frozenset()):
    """All layers over the prompt in one batched pass. Returns (cache, H^L [1, P, d], {l: H^l [1, P, d]})."""
    cache = target.new_cache()
    ids = torch.tensor([prompt_ids], device=target.device)
    hidden, captured = target.forward_all(ids, cache, 0, capture)
    return cache, hidden, captured


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

