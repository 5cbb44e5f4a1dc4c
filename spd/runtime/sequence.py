"""One request's draft-then-verify decode as a state machine: prefill, then cycles of (draft a tree, the target's
logits for its rows, settle). Whoever owns the forward drives it — `ChainDecoder` one sequence at a time over
`forward_all`, `BatchDecoder` many sequences per ragged forward — so both decode by the same walk and the same
statistics. A sequence without a drafter drafts nothing: each cycle is a plain AR step (what a batch of AR requests
runs).

Verification walks down from the root, one node at a time, with `spd.verify.sampling.settle_children` (spd.runtime.chain
says why that keeps the target's distribution at every W).
"""

from __future__ import annotations

import torch

from spd.decoding import Request, context_length, is_final, prefill
from spd.drafters.base import DRAWS, MARGIN, SIDE_ROWS, Cycle, Drafter
from spd.metrics import ChainStats
from spd.verify.sampling import KeyedDraws, next_token, propose, settle_children, top2_margin
from spd.targets.stages import StagedTarget
from spd.verify.tree import DraftTree


class ChainSequence:
    def __init__(self, target: StagedTarget, drafter: Drafter | None, eos_ids: frozenset[int],
                 prompt_ids: list[int], request: Request, m: int = 1, width: int = 1, budget: int | None = None,
                 capture=frozenset(), observe=None):
        """m: draft depth per cycle; width: children per node (W); budget: drafted nodes per cycle (None: m).
        observe(logits [V], {l: H^l}) sees the target's logits of each settled position, with the states of the
        layers in `capture`, before its token is chosen (the trace recorder; AR, where a cycle settles one position)."""
        self.target, self.drafter, self.eos_ids, self.request = target, drafter, eos_ids, request
        self.prompt_ids = list(prompt_ids)
        self.m, self.width, self.budget = m, width, budget or m
        self.observe = observe
        self.drafter_layers = frozenset(drafter.layers_needed()) if drafter else frozenset()
        self.capture = self.drafter_layers | frozenset(capture)     # what every forward of this sequence keeps
        self.generator = request.generator(target.device)
        self.draws: KeyedDraws | None = None        # sampled: the request's keyed draws (spd.verify.sampling), from start
        self.stats = ChainStats(m=m)
        self.done = False
        self.cache = None
        self.tokens: list[int] = []
        self.tree: DraftTree | None = None
        self.rows = None          # the drafter's side rows beside this cycle's tree (SIDE_ROWS' side_rows), or None
        self.fed = 0
        self.margin: float | None = None   # the target's top-2 margin at the newest verified token (MARGIN drafters)

    def context_length(self) -> int:
        return context_length(len(self.prompt_ids), self.request.max_new_tokens,
                              self.budget + (self.drafter.extra_rows if self.sides() else 0))

    def sides(self) -> bool:
        """The drafter has rows of its own to run beside each cycle's tree."""
        return self.drafter is not None and self.drafter.has(SIDE_ROWS)

    def prefill(self) -> list[int]:
        """The prompt through the target alone (a fresh static cache); returns the first token."""
        self.cache, hidden, captured = prefill(self.target, self.prompt_ids, self.capture, self.context_length())
        return self.start(self.target.logits(hidden[0, -1]), captured)

    def start(self, logits: torch.Tensor, captured: dict[int, torch.Tensor]) -> list[int]:
        if self.observe:
            self.observe(logits, captured)
        self.draws = self.request.draws(self.generator, logits.shape[-1])
        token = next_token(logits, self.request.params, self.generator, self.draws, len(self.prompt_ids))
        self.tokens = self.prompt_ids + [token]
        self.stats.N = 1
        if self.drafter:
            self.drafter.start({layer: captured[layer] for layer in self.drafter_layers}, self.tokens)
            if self.drafter.has(DRAWS):
                self.drafter.sampling_draws(self.draws)
            if self.drafter.has(MARGIN):       # a top-k and a read-back each cycle: only for a drafter that uses it
                self.margin = top2_margin(logits)
        self.done = is_final(token, 1, self.request.max_new_tokens, self.eos_ids)
        return [token]

    def draft(self) -> DraftTree:
        """This cycle's rows: the newest token (not yet through the target, at position `fed`) and its drafts."""
        self.fed = len(self.tokens) - 1
        params, generator = self.request.params, self.generator
        if self.drafter is None:
            self.tree = DraftTree(self.tokens[-1])
        else:
            self.tree = self.drafter.propose(Cycle(self.tokens[-1], self.m, self.width, self.budget, self.margin),
                                             lambda logits: propose(logits, params, generator))
        self.rows = self.drafter.side_rows() if self.sides() else None
        return self.tree

    def settle(self, logits: torch.Tensor, captured: dict[int, torch.Tensor]) -> list[int]:
        """logits [T, V] (row i: the target's p after node i's path), captured {l: H^l [1, T, d]}: walk the tree,
        keep the verified path's cache rows, tell the drafter; returns the tokens verified this cycle."""
        tree, stats, params, generator = self.tree, self.stats, self.request.params, self.generator
        if logits.shape[0] > len(tree):       # the side rows ran after the tree's (ChainDecoder.forward_tree)
            self.drafter.side_logits(logits[len(tree):])
            logits = logits[:len(tree)]
            captured = {layer: h[:, :len(tree)] for layer, h in captured.items()}
        stats.cycles += 1
        stats.drafted += len(tree) - 1
        stats.drafting_cycles += len(tree) > 1
        path, verified = [0], []
        while True:
            chose = path[-1]                  # the row whose logits choose this token
            children = tree.children(path[-1])
            if children:
                index, token = settle_children(logits[path[-1]], [tree.proposals[c - 1] for c in children],
                                               params, generator, self.draws, len(self.tokens))
                stats.verified(tree.proposals[children[index or 0] - 1].source, index is not None)
            else:                             # the path's last node held: the target's next token comes free
                if self.observe:
                    self.observe(logits[path[-1]], {layer: h[:, path[-1:]] for layer, h in captured.items()})
                index, token = None, next_token(logits[path[-1]], params, generator, self.draws, len(self.tokens))
            self.tokens.append(token)
            verified.append(token)
            stats.N += 1
            self.done = is_final(token, stats.N, self.request.max_new_tokens, self.eos_ids)
            if index is not None:
                path.append(children[index])
            if self.done or index is None:
                break
        stats.accepted += len(path) - 1
        stats.accepted_per_cycle.append(len(path) - 1)
        # the verified path's rows, at their positions; side rows sit after the tree's, so they are dropped too
        self.cache.keep(self.fed, [self.fed + node for node in path])
        if not self.done and self.drafter:
            self.drafter.observe({layer: captured[layer][:, path] for layer in self.drafter_layers}, self.tokens)
            if self.drafter.has(MARGIN):
                self.margin = top2_margin(logits[chose])
        return verified
