"""One request's draft-then-verify decode as a state machine: prefill, then cycles of (draft a tree, the target's
logits for its rows, settle). Whoever owns the forward drives it — `ChainDecoder` one sequence at a time over
`forward_all`, `BatchDecoder` many sequences per ragged forward — so both decode by the same walk and the same
statistics. A sequence without a drafter drafts nothing: each cycle is a plain AR step (what a batch of AR requests
runs).

Deterministic drafts (a context's tokens, a module's argmax, a tree's top-W children) are settled by the device step's
rule (spd.verify.accept): the target's choice after every row — its argmax, or AR's keyed draw at that position —
and the deepest draft whose every ancestor is its parent's choice. Drafts drawn from a q are settled node by node from
the root with `spd.verify.sampling.settle_children` (spd.runtime.chain says why both keep the target's distribution).
"""

from __future__ import annotations

import torch

from spd.decoding import Request, context_length, is_final, prefill
from spd.drafters.base import DRAWS, MARGIN, SIDE_ROWS, Cycle, Drafter
from spd.metrics import ChainStats
from spd.verify.accept import greedy_choices, kept_drafts, kept_path, keyed_choices
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
        """logits [T, V] (row i: the target's p after node i's path), captured {l: H^l [1, T, d]}: settle the tree,
        keep the verified path's cache rows, tell the drafter; returns the tokens verified this cycle."""
        tree, stats = self.tree, self.stats
        if logits.shape[0] > len(tree):       # the side rows ran after the tree's (ChainDecoder.forward_tree)
            self.drafter.side_logits(logits[len(tree):])
            logits = logits[:len(tree)]
            captured = {layer: h[:, :len(tree)] for layer, h in captured.items()}
        # drafts drawn from a q (or a sampled request without keyed draws) go through rejection sampling
        walk = any(p.q is not None for p in tree.proposals) or (not self.request.params.greedy and self.draws is None)
        path, verified = self.walk(logits) if walk else self.verdict(logits)
        for i, token in enumerate(verified):
            children = tree.children(path[i])
            if children:
                kept = i + 1 < len(path)
                stats.verified(tree.proposals[(path[i + 1] if kept else children[0]) - 1].source, kept)
            self.tokens.append(token)
            stats.N += 1
            self.done = is_final(token, stats.N, self.request.max_new_tokens, self.eos_ids)
            if self.done:         # an end: nothing after it is verified, nor kept
                verified, path = verified[: i + 1], path[: i + 2]
                break
        if self.observe and len(verified) == len(path) and not tree.children(path[-1]):
            # the path's last node held: the target's next token came free after it (AR's every position)
            self.observe(logits[path[-1]], {layer: h[:, path[-1:]] for layer, h in captured.items()})
        stats.cycle(len(tree) - 1, len(path) - 1)
        # the verified path's rows, at their positions; side rows sit after the tree's, so they are dropped too
        self.cache.keep(self.fed, [self.fed + node for node in path])
        if not self.done and self.drafter:
            self.drafter.observe({layer: captured[layer][:, path] for layer in self.drafter_layers}, self.tokens)
            if self.drafter.has(MARGIN):      # the margin where the last verified token was chosen
                self.margin = top2_margin(logits[path[len(verified) - 1]])
        return verified

    def verdict(self, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Deterministic drafts: the target's choice after every row (greedy: its argmax; sampled: AR's keyed draw
        at that row's position), and spd.verify.accept's verdict on them — the device step's rule. Returns the kept
        path's nodes (root first) and the verified tokens (one per path node: the kept drafts, then the choice after
        the last)."""
        tree, params = self.tree, self.request.params
        depths, tokens, parents = tree.depths(), tree.tokens(), [0, *tree.parents]
        if params.greedy:
            chosen, chances = greedy_choices(logits).cpu(), None                       # [T], read once a cycle
        else:
            chosen, chances = keyed_choices(logits, params, self.draws, [len(self.tokens) + d for d in depths],
                                            tokens, parents)
        tokens = torch.tensor(tokens)                                                  # [T]
        if tree.is_chain():
            kept = int(kept_drafts(tokens[1:], chosen[:-1]))
            path = list(range(kept + 1))
        else:
            kept, _, rows = kept_path(tokens, chosen, torch.ones(len(tree), dtype=torch.bool), torch.tensor(depths),
                                      torch.tensor(parents), tree.visibility())
            path = rows[: int(kept) + 1].tolist()
        verified = [tree.token(node) for node in path[1:]] + [int(chosen[path[-1]])]
        if chances is not None:       # the target's p of each verified draw, for drafters that read it (DRAWS)
            self.draws.drawn.update((len(self.tokens) + d, chances[node]) for d, node in enumerate(path))
        return path, verified

    def walk(self, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Drafts drawn from a q: rejection sampling node by node from the root (settle_children), as `verdict`
        returns. Every token is settled, the last one too, before the caller looks for an end."""
        tree, params, generator = self.tree, self.request.params, self.generator
        path, verified = [0], []
        while True:
            children = tree.children(path[-1])
            position = len(self.tokens) + len(verified)
            if not children:                  # the path's last node held: the target's next token comes free
                verified.append(next_token(logits[path[-1]], params, generator, self.draws, position))
                return path, verified
            index, token = settle_children(logits[path[-1]], [tree.proposals[c - 1] for c in children], params,
                                           generator, self.draws, position)
            verified.append(token)
            if index is None:
                return path, verified
            path.append(children[index])
