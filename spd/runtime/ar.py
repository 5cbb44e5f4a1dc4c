"""Plain autoregressive decoding through the same stage runner: the reference for losslessness and speed."""

from __future__ import annotations

import torch

from spd.decoding import Decoder, Request, context_length, is_final, prefill
from spd.verify.sampling import next_token
from spd.targets.stages import StagedTarget


class ARDecoder(Decoder):
    """One target forward per token over the unsplit target. observe(logits [V], {l: H^l [1, 1 or P, d]}), when
    given, sees what each forward produced before its token is chosen (the fast evaluator's trace recorder)."""

    def __init__(self, target: StagedTarget, eos_ids: frozenset[int], capture=frozenset(), observe=None):
        self.target, self.eos_ids, self.capture, self.observe = target, eos_ids, frozenset(capture), observe

    @torch.no_grad()
    def stream(self, prompt_ids, request: Request):
        target, params = self.target, request.params
        generator = request.generator(target.device)
        length = context_length(len(prompt_ids), request.max_new_tokens, 0)
        cache, hidden, captured = prefill(target, prompt_ids, self.capture, length)
        produced, draws, device = 0, None, target.device      # the device read once: it walks the parameters
        while True:
            logits = target.logits(hidden[0, -1])
            if self.observe:
                self.observe(logits, captured)
            if produced == 0:                   # keyed as a draft-then-verify decode keys them
                draws = request.draws(generator, logits.shape[-1])
            token = next_token(logits, params, generator, draws, len(prompt_ids) + produced)
            produced += 1
            yield token
            if is_final(token, produced, request.max_new_tokens, self.eos_ids):
                return
            ids = torch.full((1, 1), token, dtype=torch.long, device=device)
            hidden, captured = target.forward_all(ids, cache, len(prompt_ids) + produced - 1, self.capture)

