"""Context statistics as drafts, priced per cycle (`method=suffix`; SuffixDecoding's idea — counts of what followed
the context's suffix earlier — not its code).

Candidates: every earlier occurrence of the longest suffix of the context (prompt + verified tokens) that occurred
before, and, while those are few, of shorter suffixes (each step shorter weighs half), each proposing its
continuation. The continuations merge into a trie whose every node carries its weight, so a child's share of its
parent's weight is an empirical probability; the tree grows best-first by the product of those shares along the
path (at most W children a node, depth <= m, `budget` nodes).

Pricing (spd.pricing): each candidate's chance of being kept comes from an acceptance predictor calibrated online
on this request's verdicts (by source, match length, share, support, depth; scaled by the request's kept-over-expected
ratio where the target was as sure, by its top-2 margin at the newest verified token) — every candidate of a cycle is
judged against the tokens the cycle verified, drafted or not; the forward carries the prefix of candidates, best
first, that maximises expected tokens per second under this machine's row-cost profile, if that beats a plain step
by the edge. A cycle worth nothing drafts nothing (a plain AR step). Every candidate is deterministic
(q = None), so verification keeps each child with exactly its p (`spd.verify.sampling.settle_children`): greedy follows
the argmax, sampling one draw of p — at T = 1 the predictor learns the sampled acceptance. That draw is keyed
(spd.verify.sampling.KeyedDraws): the noise that will choose each position is known before the forward, so at T = 1 a
candidate is priced by its chance given its own noise (spd.pricing.given_noise) — a likely token whose noise is low
is left out, an unlikely one whose noise is high drafted — and a context candidate by its recall too: the target's p
of its token at the earlier occurrences that propose it, as the draws recorded it (the request's own answer; the
prompt's tokens were not drawn and carry none).

A datastore (`Retrieval`, spd.corpora.datastore: `datastore=sharegpt` in the default on a CPU) adds a second trie: the
continuations of the context's longest match in a corpus, as candidates of their own source ("datastore"), priced and
calibrated apart from the context's — kept a third to half as often, they would otherwise talk the context down.

An opt-in memory (`SuffixMemory`, shared by the drafters of one engine) adds earlier requests' prompts and answers to
the occurrences searched, and keeps the predictor's counts from one request to the next: it changes which tokens are
drafted, never which are output. Without it each request starts from the predictor's prior, so eval's prompts (which
never use the memory) cannot change each other's figures, and the fast evaluator's fresh drafter per prompt is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spd.corpora.datastore import Datastore
from spd.drafters.base import CHAIN, DRAWS, MARGIN, TREES, Cycle, Drafter
from spd.drafters.lookup import NgramIndex
from spd.pricing import NOISE_SHARE, AcceptancePredictor, Evidence, RowCosts, choose, given_noise
from spd.verify.sampling import Proposal
from spd.methods import SelfDraftKeys
from spd.spec import LookupOptions, SuffixOptions
from spd.verify.tree import DraftTree

DATASTORE = "datastore"   # the source of candidates a datastore proposed
NAN = float("nan")
SEPARATOR = -1      # between requests in a memory: no n-gram of real tokens contains it


class SuffixMemory:
    """Earlier requests' token sequences, one n-gram index over all of them (a separator between two)."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int = 1 << 20):
        self.index = NgramIndex(min_n, max_n)
        self.max_tokens = max_tokens

    def add(self, tokens: list[int]) -> None:
        if len(self.index) + len(tokens) + 1 <= self.max_tokens:   # full: the memory stops growing
            self.index.extend([*tokens, SEPARATOR])


@dataclass(frozen=True)
class Retrieval:
    """How the drafter reads a datastore (spd.corpora.datastore): the longest match of the context's last max_n tokens (at
    least min_n), `limit` of its occurrences spread over the corpus, their next `depth` tokens. Over the 30 eval
    prompts' greedy traces a sample of 16 predicted the same speedup as 64 or 256 (docs/speed-cpu.md, "How the default drafts and prices")."""
    store: Datastore
    max_n: int = 16
    min_n: int = 2
    limit: int = 16
    depth: int = 8


@dataclass
class _Node:
    token: int
    parent: int                  # index in the candidate list, -1 = the root
    depth: int
    weight: float = 0.0
    children: dict = field(default_factory=dict)     # token -> candidate index
    recalled: float = 0.0        # the weight of the occurrences that knew the target's p of the token, times that p
    known: float = 0.0           # the weight of those occurrences


def judged(nodes: list[_Node], new: list[int]) -> list[tuple[int, bool]]:
    """[(candidate index, kept)] for every candidate whose parent the verified tokens `new` reached — kept iff the
    verified token is its token — whether or not it was drafted: a deterministic child is kept exactly when the
    target's own choice (the argmax, or the one draw of p) equals it, so a priced-out candidate is judged as a drafted
    one would have been, and a bucket priced out once can still win its way back."""
    verdicts, parent = [], -1
    for token in new:
        kept = None
        for i, node in enumerate(nodes):
            if node.parent == parent:
                verdicts.append((i, node.token == token))
                if node.token == token:
                    kept = i
        if kept is None:
            break
        parent = kept
    return verdicts


class SuffixDrafter(Drafter):
    capabilities = frozenset({CHAIN, TREES, MARGIN, DRAWS})

    def __init__(self, min_n: int = 1, max_n: int = 8, costs: RowCosts | None = None,
                 memory: SuffixMemory | None = None, enough: int = 8, max_occurrences: int = 64, edge: float = 0.1,
                 retrieval: Retrieval | None = None):
        """costs: this machine's row costs (None: every row count costs the same, so every candidate is drafted up
        to the budget); enough: occurrences of the longest match after which shorter matches are not consulted;
        edge: how much a draft's predicted rate must beat a plain step's (spd.pricing.choose); retrieval: a datastore
        whose continuations of the context's suffix are candidates too (source "datastore")."""
        self.min_n, self.max_n, self.retrieval = min_n, max_n, retrieval
        self.costs, self.memory, self.edge = costs, memory, edge
        self.enough, self.max_occurrences = enough, max_occurrences
        self.predictor = AcceptancePredictor()
        self.index: NgramIndex | None = None
        self.recalled: list[float] = []               # per context position: the target's p of its token (NaN: unknown)
        self.last: tuple[list[_Node], list[Evidence]] | None = None   # the cycle's candidates, drafted or not
        self.margin = float("inf")                    # the target's confidence at the newest verified token
        self.draws = None                             # sampled: the request's keyed draws (spd.verify.sampling)
        self.cycles = self.priced_out = 0             # cycles drafted, and those the pricing made plain AR steps

    def start(self, prompt_hidden, tokens) -> None:
        if self.memory is None:
            self.predictor = AcceptancePredictor()   # each request on its own: nothing of one decides another's drafts
        elif self.index is not None:
            self.memory.add(self.index.tokens)        # the previous request, as far as it was verified
        self.index = NgramIndex(self.min_n, self.max_n)
        self.index.extend(tokens)
        self.recalled = [NAN] * len(tokens)
        self.last = None

    def sampling_draws(self, draws) -> None:
        self.draws = draws
        if self.recalled:
            self.recalled[-1] = self._chance(len(self.recalled) - 1)     # the first token, drawn before the draws came

    def observe(self, hidden, tokens) -> None:
        new = tokens[len(self.index):]
        if self.last is not None:
            self._learn(*self.last, new)
        at = len(self.index)
        self.index.extend(new)
        self.recalled += [self._chance(at + k) for k in range(len(new))]
        self.last = None

    def _chance(self, position: int) -> float:
        """The target's p of the token drawn at `position`, as the draws recorded it (NaN: greedy)."""
        return self.draws.chance(position) if self.draws is not None else NAN

    def _learn(self, nodes: list[_Node], evidence: list[Evidence], new: list[int]) -> None:
        for i, kept in judged(nodes, new):
            self.predictor.observe(evidence[i], kept)

    def _occurrences(self) -> tuple[int, list[tuple[NgramIndex, int, float]]]:
        """(the longest match length, [(index, continuation start, weight)]) over the context and the memory."""
        indices = [self.index] + ([self.memory.index] if self.memory is not None else [])
        suffix_of = self.index.tokens
        found, seen, longest = [], set(), 0
        for n in range(min(self.max_n, len(suffix_of)), self.min_n - 1, -1):
            gram = tuple(suffix_of[len(suffix_of) - n:])
            for which, index in enumerate(indices):
                start = index.tables[n].get(gram) if n in index.tables else None   # a memory may match fewer sizes
                while start is not None and len(found) < self.max_occurrences:
                    if (which, start) not in seen:
                        seen.add((which, start))
                        longest = longest or n
                        found.append((index, start, 0.5 ** (longest - n)))
                    start = index.older.get((n, start))
            if len(found) >= self.enough:
                break
        return longest, found

    def candidates(self, m: int, width: int, budget: int) -> tuple[list[_Node], list[Evidence]]:
        """The trie of the occurrences' continuations, best first (parents before children) with each node's
        evidence; at most `budget` nodes, W children a node, depth m. With a datastore, its trie's best `budget`
        nodes follow as another source, under first tokens the context did not propose and in the root's room left
        (a chain, W = 1, reads the corpus only where the context proposes nothing)."""
        longest, found = self._occurrences()
        paths = [(_continuation(index, start, m, index is self.index), weight,
                  self.recalled[start: start + m] if index is self.index else ()) for index, start, weight in found]
        nodes, evidence = _best_first(paths, width, budget, Evidence("suffix", longest, 0.0, 0.0, 0, self.margin))
        if self.retrieval is not None:
            r = self.retrieval
            n, following = r.store.continuations(self.index.tokens, r.max_n, r.min_n, r.limit, min(m, r.depth))
            first = {node.token for node in nodes if node.parent < 0}
            more, more_evidence = _best_first([(path, 1.0, ()) for path in following], width, budget,
                                              Evidence(DATASTORE, n, 0.0, 0.0, 0, self.margin), skip=first)
            offset = len(nodes)
            nodes += [_Node(node.token, node.parent + offset if node.parent >= 0 else -1, node.depth, node.weight)
                      for node in more]
            evidence += more_evidence
        return nodes, evidence

    def propose(self, cycle: Cycle, choose=None) -> DraftTree:
        root, budget = cycle.root, cycle.budget
        if cycle.margin is not None:
            self.margin = cycle.margin
        nodes, evidence = self.candidates(cycle.m, cycle.width, budget)
        chance = [self.predictor.predict(e) for e in evidence]
        if self.draws is not None:      # sampled: the noise that will choose each node's position is known already
            at = len(self.index.tokens) - 1             # the root's position
            chance = [given_noise(c, self.draws.uniform(at + node.depth, node.token), NOISE_SHARE)
                      for c, node in zip(chance, nodes)]
        reach = _along_paths(nodes, chance)
        # the candidates by predicted reach, parents first (a child's reach never exceeds its parent's)
        order = sorted(range(len(nodes)), key=lambda i: (-reach[i], nodes[i].depth, i))
        ranked = order[:budget]
        take = self.carried([reach[i] for i in ranked], [evidence[i].source for i in ranked])
        self.cycles += 1
        self.priced_out += bool(nodes) and take == 0
        chosen = sorted(order[:take])          # candidate order is parents first
        tree, node_of = DraftTree(root), {-1: 0}
        for i in chosen:
            node_of[i] = tree.add(node_of[nodes[i].parent], Proposal(nodes[i].token, source=evidence[i].source))
        self.last = (nodes, evidence)
        return tree

    def carried(self, reach: list[float], sources: list[str]) -> int:
        """How many of the ranked candidates (their reach, best first; their sources) the forward carries: what
        pays by this machine's row costs, or every one without them. A drafter with rows of its own to add beside
        them (spd.drafters.suffix_branches) prices those here too."""
        return len(reach) if self.costs is None else choose(reach, self.costs, self.edge)


def _best_first(paths: list[tuple[list[int], float, list[float]]], width: int, budget: int, like: Evidence,
                skip: set[int] = frozenset()) -> tuple[list[_Node], list[Evidence]]:
    """paths [(tokens, weight, the target's p of each token where it occurred, as far as known)] merged into a trie
    whose nodes carry the weight that reached them; its best `budget` nodes by the product of shares along the path
    (parents before children, W children a node; the root's first tokens in `skip` are another source's, left out
    and counted against its W), each with its evidence: `like` with the node's share, support, depth and recall
    (the weighted mean of the known p's that reached it)."""
    nodes: list[_Node] = []
    root_children: dict[int, int] = {}
    total = 0.0
    for path, weight, recalls in paths:
        total += weight
        children, parent = root_children, -1
        for k, token in enumerate(path):
            child = children.get(token)
            if child is None:
                child = children[token] = len(nodes)
                nodes.append(_Node(token, parent, 1 if parent < 0 else nodes[parent].depth + 1))
            node = nodes[child]
            node.weight += weight
            if k < len(recalls) and recalls[k] == recalls[k]:
                node.recalled += weight * recalls[k]
                node.known += weight
            children, parent = node.children, child
    share = [node.weight / (nodes[node.parent].weight if node.parent >= 0 else total) for node in nodes]
    reach = _along_paths(nodes, share)
    order = sorted(range(len(nodes)), key=lambda i: (-reach[i], nodes[i].depth, i))
    kept, position, count_of = [], {}, {-1: len(skip)}
    for i in order:
        if len(kept) == budget:
            break
        parent = nodes[i].parent
        if (parent >= 0 and parent not in position) or (parent < 0 and nodes[i].token in skip):
            continue
        if count_of.get(parent, 0) >= width:
            continue
        count_of[parent] = count_of.get(parent, 0) + 1
        position[i] = len(kept)
        kept.append(i)
    out = [_Node(nodes[i].token, position[nodes[i].parent] if nodes[i].parent >= 0 else -1, nodes[i].depth,
                 nodes[i].weight) for i in kept]
    evidence = [Evidence(like.source, like.match, share[i], nodes[nodes[i].parent].weight if nodes[i].parent >= 0
                         else total, nodes[i].depth, like.margin,
                         nodes[i].recalled / nodes[i].known if nodes[i].known else NAN) for i in kept]
    return out, evidence


def _along_paths(nodes: list[_Node], chance: list[float]) -> list[float]:
    """Each node's chance times its ancestors' (nodes parents first): the chance its whole path holds."""
    out: list[float] = []
    for node, own in zip(nodes, chance):
        out.append(own * (out[node.parent] if node.parent >= 0 else 1.0))
    return out


def _continuation(index: NgramIndex, start: int, count: int, loops: bool) -> list[int]:
    """`count` tokens from `start` on: the context's own copy may read its output past the end (a loop repeats); a
    memory's stops at the end of its request."""
    if loops:
        return index.continuation(start, count)
    out = []
    for token in index.tokens[start: start + count]:
        if token == SEPARATOR:
            break
        out.append(token)
    return out


def chain_drafter(*, lookup: LookupOptions, suffix: SuffixOptions, selfdraft: SelfDraftKeys,
                  row_costs: RowCosts | None, memory: SuffixMemory | None,
                  retrieval: Retrieval | None) -> SuffixDrafter:
    """The context statistics' drafter (spd.methods), priced with this machine's row costs (None: draft_pricing=false):
    matches of one token up to lookup_max_ngram (lookup_min_ngram is the lookup's: here the pricing decides whether a
    short match drafts; over the 240 eval traces one-token matches raise the predicted speedup to 2.22x from 2.19x,
    docs/speed-cpu.md); with suffix_branches, Self-Draft's branches (branches, branch_length, gram) as a priced
    source too (spd.drafters.suffix_branches)."""
    if suffix.branches:
        from spd.drafters.selfdraft import DraftBranches
        from spd.drafters.suffix_branches import SuffixBranchesDrafter
        return SuffixBranchesDrafter(DraftBranches(selfdraft.branches, selfdraft.branch_length, selfdraft.gram), 1,
                                     lookup.max_ngram, costs=row_costs, memory=memory, retrieval=retrieval)
    return SuffixDrafter(1, lookup.max_ngram, costs=row_costs, memory=memory, retrieval=retrieval)
