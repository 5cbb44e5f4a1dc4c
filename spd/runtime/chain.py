"""Draft-then-verify decoding (EAGLE-3's chain, design §2; the context lookup): the drafter proposes up to m
tokens, the whole target checks them in one forward, the longest verified prefix is kept, and the target's own
token at the first miss (or after the last draft) comes free. No pipeline: the target runs unsplit. A drafter
with nothing to propose makes the cycle a plain AR step.

Greedy keeps a draft iff it is the target's argmax; sampling accepts draft x ~ q with probability
min(1, p(x)/q(x)) (a deterministic draft: p(x)) and otherwise draws from norm(max(0, p - q)) and stops the cycle
(the rules of `spd.sampling`, applied in order along the chain), so the output is the target's own distribution.
"""

from __future__ import annotations

import torch

from spd.decoding import Decoder, Request, context_length, is_final, prefill
from spd.drafters.base import ChainDrafter
from spd.metrics import ChainStats
from spd.sampling import next_token, propose, settle
from spd.targets.stages import StagedTarget


class ChainDecoder(Decoder):
    def __init__(self, target: StagedTarget, drafter: ChainDrafter, eos_ids: frozenset[int], m: int):
        if m < 1:
            raise ValueError(f"m={m} draft tokens per cycle must be >= 1")
        self.target, self.drafter, self.eos_ids, self.m = target, drafter, eos_ids, m
        self.capture = frozenset(drafter.layers_needed())

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        target, params, max_new = self.target, request.params, request.max_new_tokens
        generator = request.generator(target.device)
        stats = self.stats = ChainStats(m=self.m)
        length = context_length(len(prompt_ids), max_new, self.m)   # the last cycle feeds m drafts past it
        cache, hidden, captured = prefill(target, prompt_ids, self.capture, length)
        tokens = list(prompt_ids) + [next_token(target.logits(hidden[0, -1]), params, generator)]
        stats.N = 1
        yield tokens[-1]
        self.drafter.start(captured, tokens)
        done = is_final(tokens[-1], stats.N, max_new, self.eos_ids)
        while not done:
            fed = len(tokens) - 1                 # position of the newest token: settled, not yet through the target
            drafts = self.drafter.draft(self.m, lambda logits: propose(logits, params, generator))   # <= m
            ids = torch.tensor([[tokens[-1], *(d.token for d in drafts)]], device=target.device)
            out, captured = target.forward_all(ids, cache, fed, self.capture)
            logits = target.logits(out[0])        # [len(drafts) + 1, V]: row j is the target's p for position fed + 1 + j
            stats.cycles += 1
            stats.drafted += len(drafts)
            stats.drafting_cycles += bool(drafts)
            accepted = 0
            verified = []
            for j in range(len(drafts) + 1):
                if j < len(drafts):
                    ok, token = settle(logits[j], drafts[j].token, drafts[j].q, params, generator)
                    stats.verified(drafts[j].source, ok)
                else:                             # every draft held: the target's next token comes free
                    ok, token = False, next_token(logits[j], params, generator)
                tokens.append(token)
                verified.append(token)
                stats.N += 1
                accepted += ok
                done = is_final(token, stats.N, max_new, self.eos_ids)
                if done or not ok:
                    break
            stats.accepted += accepted
            stats.accepted_per_cycle.append(accepted)
            cache.crop(len(tokens) - 1)           # keep the fed positions that were verified
            if not done:
                self.drafter.verified({layer: h[:, : accepted + 1] for layer, h in captured.items()}, tokens)
            yield from verified                   # the cycle's state is settled before its tokens go out
