"""Plain autoregressive decoding through the same stage runner: the reference for losslessness and speed."""

from __future__ import annotations

import time

import torch

from spd.decoding import GenerationResult, context_length, is_final, prefill
from spd.sampling import SamplingParams, next_token
from spd.target.stages import StagedTarget


@torch.no_grad()
def ar_generate(target: StagedTarget, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                eos_ids: frozenset[int], generator: torch.Generator | None = None, on_token=None) -> GenerationResult:
    """on_token(token_id): called for every token as it is sampled (streaming output)."""
    start = time.perf_counter()
    cache, hidden, _ = prefill(target, prompt_ids, max_length=context_length(len(prompt_ids), max_new_tokens, 0))
    token = next_token(target.logits(hidden[0, -1]), params, generator)
    out = [token]
    if on_token:
        on_token(token)
    while not is_final(token, len(out), max_new_tokens, eos_ids):
        ids = torch.tensor([[token]], device=target.device)
        hidden, _ = target.forward_all(ids, cache, start_pos=len(prompt_ids) + len(out) - 1)
        token = next_token(target.logits(hidden[0, -1]), params, generator)
        out.append(token)
        if on_token:
            on_token(token)
    return GenerationResult(token_ids=out, seconds=time.perf_counter() - start)
