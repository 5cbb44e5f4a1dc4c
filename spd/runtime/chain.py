"""Draft-then-verify decoding (EAGLE-3's chain and dynamic tree, design §2 and §8; the context lookup): the drafter
proposes a chain of up to m tokens (W = 1) or a tree (W > 1), the whole target checks every node in one forward
(a tree under its ancestor mask, each node at prefix + depth), the longest verified path is kept, and the target's
own token at the first miss (or after the path's last node) comes free. No pipeline: the target runs unsplit. A
drafter with nothing to propose makes the cycle a plain AR step.

Verification walks down from the root, one node at a time, with `spd.sampling.settle_children`: greedy descends into
the child that is the target's argmax; sampling keeps a chain's draft x ~ q with probability min(1, p(x)/q(x)) (a
deterministic draft: p(x)) and otherwise draws from norm(max(0, p - q)), and a node with several children keeps
each with exactly its share of p — so the output is the target's own distribution at every W.
"""

from __future__ import annotations

import torch

from spd.decoding import Decoder, Request, context_length, is_final, prefill
from spd.drafters.base import ChainDrafter
from spd.metrics import ChainStats
from spd.sampling import next_token, propose, settle_children
from spd.targets.stages import StagedTarget
from spd.tree import DraftTree


class ChainDecoder(Decoder):
    def __init__(self, target: StagedTarget, drafter: ChainDrafter, eos_ids: frozenset[int], m: int,
                 width: int = 1, budget: int | None = None):
        """width: children per node (W; 1 = a chain); budget: drafted nodes per cycle (None: m, a chain's)."""
        if m < 1:
            raise ValueError(f"m={m} draft tokens per cycle must be >= 1")
        if width < 1 or (width > 1 and not drafter.branches):
            raise ValueError(f"W={width}: {type(drafter).__name__} drafts chains only (W = 1)")
        self.target, self.drafter, self.eos_ids, self.m = target, drafter, eos_ids, m
        self.width, self.budget = width, budget or m
        self.capture = frozenset(drafter.layers_needed())

    def forward_tree(self, tree: DraftTree, cache, fed: int):
        """The target over every node of the tree (the root at position `fed`): (logits [T, V], captured)."""
        ids = torch.tensor([tree.tokens()], device=self.target.device)
        if tree.is_chain():     # contiguous positions, causal: the plain path, bit for bit
            out, captured = self.target.forward_all(ids, cache, fed, self.capture)
        else:
            out, captured = self.target.forward_all(ids, cache, fed, self.capture,
                                                    offsets=torch.tensor(tree.depths()), visible=tree.visibility())
        return self.target.logits(out[0]), captured

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], request: Request):
        target, params, max_new = self.target, request.params, request.max_new_tokens
        generator = request.generator(target.device)
        stats = self.stats = ChainStats(m=self.m)
        length = context_length(len(prompt_ids), max_new, self.budget)   # the last cycle feeds its tree past it
        cache, hidden, captured = prefill(target, prompt_ids, self.capture, length)
        tokens = list(prompt_ids) + [next_token(target.logits(hidden[0, -1]), params, generator)]
        stats.N = 1
        yield tokens[-1]
        self.drafter.start(captured, tokens)
        done = is_final(tokens[-1], stats.N, max_new, self.eos_ids)
        choose = lambda logits: propose(logits, params, generator)     # noqa: E731
        while not done:
            fed = len(tokens) - 1                 # position of the newest token: settled, not yet through the target
            tree = self.drafter.draft_tree(tokens[-1], self.m, self.width, self.budget, choose)
            logits, captured = self.forward_tree(tree, cache, fed)   # row i: the target's p after node i's path
            stats.cycles += 1
            stats.drafted += len(tree) - 1
            stats.drafting_cycles += len(tree) > 1
            path, verified = [0], []
            while True:
                children = tree.children(path[-1])
                if children:
                    index, token = settle_children(logits[path[-1]], [tree.proposals[c - 1] for c in children],
                                                   params, generator)
                    stats.verified(tree.proposals[children[index or 0] - 1].source, index is not None)
                else:                             # the path's last node held: the target's next token comes free
                    index, token = None, next_token(logits[path[-1]], params, generator)
                tokens.append(token)
                verified.append(token)
                stats.N += 1
                done = is_final(token, stats.N, max_new, self.eos_ids)
                if index is not None:
                    path.append(children[index])
                if done or index is None:
                    break
            stats.accepted += len(path) - 1
            stats.accepted_per_cycle.append(len(path) - 1)
            cache.keep(fed, [fed + node for node in path])    # the verified path's rows, at their positions
            if not done:
                self.drafter.verified({layer: h[:, path] for layer, h in captured.items()}, tokens)
            yield from verified                   # the cycle's state is settled before its tokens go out
