"""Multi-Branch Self-Drafting (Self-Draft, Gao et al., AAAI 2025): the target drafts for itself, with no other model
and no training.

Draft branches. N branches (`branches`) of up to L tokens (`branch_length`) ride in every verification forward
beside the tree being verified (the SIDE_ROWS capability's side_rows, run by spd.runtime.chain.ChainDecoder.forward_tree). Each
branch sees the verified context (the cache and the root, the newest verified token) and its own earlier tokens only:
block-diagonal causal masks, no branch sees another branch or a drafted node, and no drafted node sees a branch. A
branch is the paper's "random padding" after the context: its j-th token sits at position (root's + 1 + j), right
after the context, so row j's prediction is the target's guess of the token after [context; branch[:j + 1]] — the
lookahead-style position that makes each prediction a continuation of the current context (a branch shifted
elsewhere would read as a gap in the text and predict worse). Branches start as one random token each (drawn from
the prompt, seeded, so runs repeat), and each forward appends its last row's prediction and drops its first token
once past L (the paper's update rule; the intermediate predictions update nothing but the context cache). Their K/V
never stay: the settle keeps only the accepted path's cache rows, which sit before the branch rows.

Context cache. Every window of a branch gives a contextual n-gram: G - 1 branch tokens ending at row k plus row k's
prediction (G = `gram`), kept in an LRU queue per first token (`lru` per key, the newest first, each with how often
it was seen). The branches and this cache are `DraftBranches`, which the priced context statistics also read as a
source of candidates (spd.drafters.suffix_branches, `suffix_branches=true`). With `verified_ngrams` (the default)
every G-token window of the prompt and of the verified text joins the same cache after the cycle's branch n-grams, as
the authors' code does (its context cache takes the decoded text's windows beside the branches'; the paper's text
names the branches' only): text that repeats itself — code above all — then offers its own continuations.

Corpus cache (`corpus`, a `CorpusNgrams` or None). The paper counts n-grams over OANC, a general English corpus; OANC
is not available here, so the suite counts them over the ShareGPT assistant turns of its own datastore
(spd.corpora.retrieval, the first `CORPUS_TOKENS` tokens; built once per tokenizer, cached beside the datastore). Lookups
try the longer prefix first (the two newest verified tokens), then the root alone, each list most frequent first.

Candidates. The continuations keyed by the root (the newest verified token): the context cache's first, then the
corpus's fill the remaining ones, up to `candidates` (default N), merged as a trie and verified in the same forward
under the tree's ancestor mask; the walk (spd.runtime.sequence, `spd.verify.sampling.settle_children`) keeps the longest
verified path. Every candidate is deterministic (q = None) and branch predictions are argmaxes that draw no noise, so
greedy and sampled outputs stay the target's own.
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict

import numpy as np
import torch

from spd.drafters.base import CHAIN, DEVICE_SIDE, SIDE_ROWS, TREES, Cycle, Drafter, merged_tree
from spd.drafters.selfdraft_device import DeviceBranches
from spd.methods import SelfDraftKeys
from spd.verify.tree import DraftTree

CORPUS_TOKENS = 2_000_000     # corpus n-grams are counted over this prefix of the datastore's tokens
CORPUS_TOP = 4                # continuations kept per key, most frequent first


class CorpusNgrams:
    """The corpus cache: {key (1 or 2 tokens): [continuation (G - 1 tokens), ...] most frequent first}."""

    def __init__(self, table: dict[tuple[int, ...], list[tuple[int, ...]]]):
        self.table = table

    def lookup(self, context: list[int]) -> list[tuple[int, ...]]:
        """The continuations of the context's end: its two newest tokens' first (the longer prefix), then the newest
        token's."""
        out = []
        for size in (2, 1):
            if len(context) >= size:
                for cont in self.table.get(tuple(context[-size:]), ()):
                    if cont not in out:
                        out.append(cont)
        return out

    @classmethod
    def count(cls, tokens: np.ndarray, gram: int, separator: int | None = None, top: int = CORPUS_TOP,
              min_count: int = 2) -> "CorpusNgrams":
        """The n-grams of `tokens` (a 1-D id array; windows holding `separator` skipped): for every 1-token key the
        `top` most frequent (gram - 1)-token continuations, for every 2-token key likewise (windows of gram + 1),
        each seen at least `min_count` times."""
        tokens = np.asarray(tokens, dtype=np.int64)
        table: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for key_size in (2, 1):
            width = key_size + gram - 1
            if len(tokens) < width:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(tokens, width)
            if separator is not None:
                windows = windows[~(windows == separator).any(1)]
            rows, counts = np.unique(windows, axis=0, return_counts=True)
            keep = counts >= min_count
            rows, counts = rows[keep], counts[keep]
            # by key, then most frequent first
            order = np.lexsort((-counts, *[rows[:, i] for i in range(key_size - 1, -1, -1)]))
            for row in rows[order].tolist():
                entries = table.setdefault(tuple(row[:key_size]), [])
                if len(entries) < top:
                    entries.append(tuple(row[key_size:]))
        return cls(table)

    def save(self, path: str) -> None:
        keys = list(self.table)
        flat = [(key, cont) for key in keys for cont in self.table[key]]
        np.savez(path + ".tmp.npz", keys=np.array([list(k) + [-1] * (2 - len(k)) for k, _ in flat], dtype=np.int64),
                 conts=np.array([c for _, c in flat], dtype=np.int64))
        os.replace(path + ".tmp.npz", path)

    @classmethod
    def load(cls, path: str) -> "CorpusNgrams":
        data = np.load(path)
        table: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for key, cont in zip(data["keys"].tolist(), data["conts"].tolist()):
            table.setdefault(tuple(k for k in key if k >= 0), []).append(tuple(cont))
        return cls(table)


def corpus_ngrams(tokenizer, vocab_size: int, gram: int, log=print) -> CorpusNgrams | None:
    """The ShareGPT corpus cache of this tokenizer (spd.corpora.retrieval's datastore, its first CORPUS_TOKENS tokens),
    counted once and cached as .npz beside the datastore; None where the datastore cannot be built here."""
    from spd.corpora.datastore import tokenizer_key
    from spd.corpora.retrieval import SHAREGPT, open_datastore
    from spd.targets.weight_cache import cache_root

    try:
        key = tokenizer_key(tokenizer)
        path = os.path.join(cache_root(), "datastore", f"selfdraft-{SHAREGPT}-{key}-g{gram}.npz")
        if os.path.isfile(path):
            return CorpusNgrams.load(path)
        store = open_datastore(SHAREGPT, tokenizer, vocab_size, log)
        tokens = np.asarray(store.rev[::-1][:CORPUS_TOKENS])
        ngrams = CorpusNgrams.count(tokens, gram, separator=store.separator)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        ngrams.save(path)
        return ngrams
    except Exception as exc:      # no corpus here (offline, a tiny test tokenizer): the context cache alone
        log(f"selfdraft: no corpus n-grams ({type(exc).__name__}: {exc}); drafting from the context cache alone")
        return None


class DraftBranches:
    """N draft branches (`branches`) of up to L tokens (`branch_length`) and the contextual n-grams they leave (the
    module's docstring says how they run and update): what SelfDraftDrafter drafts from, and a source of the priced
    context statistics' candidates (spd.drafters.suffix_branches). `context` keeps, per first token, each
    continuation with how often the branches produced it, the newest last."""

    def __init__(self, branches: int = 6, branch_length: int = 6, gram: int = 4, lru: int = 16, seed: int = 0):
        if branches < 0 or branch_length < 1 or gram < 2:
            raise ValueError(f"selfdraft: branches={branches} >= 0, branch_length={branch_length} >= 1 and "
                             f"gram={gram} >= 2 needed")
        self.n, self.length, self.gram, self.lru, self.seed = branches, branch_length, gram, lru, seed
        self.branch: list[list[int]] = []
        self.context: dict[int, OrderedDict] = {}
        self.grams_added = 0

    def start_branches(self, tokens: list[int]) -> None:
        """A fresh request: an empty context cache, and each branch one random token of the prompt."""
        rng = random.Random(self.seed)
        self.branch = [[rng.choice(tokens)] for _ in range(self.n)]
        self.context = {}
        self.grams_added = 0

    def branch_rows(self, which: list[int] | None = None):
        """The rows of the branches `which` (None: all), one after another: (tokens, offsets, visible), as
        SIDE_ROWS' side_rows gives them."""
        chosen = [self.branch[i] for i in (range(self.n) if which is None else which)]
        ids, offsets = [], []
        visible = torch.zeros(sum(map(len, chosen)), sum(map(len, chosen)), dtype=torch.bool)
        for branch in chosen:
            start = len(ids)
            ids += branch
            offsets += range(1, len(branch) + 1)     # token j at the root's position + 1 + j: right after the context
            visible[start:len(ids), start:len(ids)] = torch.tril(torch.ones(len(branch), len(branch),
                                                                            dtype=torch.bool))
        return ids, offsets, visible

    def branch_logits(self, logits: torch.Tensor, which: list[int] | None = None) -> None:
        """The target's logits of the rows branch_rows(which) gave: their n-grams remembered, each branch updated."""
        predicted = logits.argmax(-1).tolist()       # drafts: the argmax, which draws none of the request's noise
        which = list(range(self.n)) if which is None else which
        starts = np.cumsum([0] + [len(self.branch[i]) for i in which]).tolist()
        self.branch_predictions({i: predicted[a:b] for i, a, b in zip(which, starts, starts[1:])})

    def branch_predictions(self, predicted: dict[int, list[int]]) -> None:
        """Each branch's row predictions (branch i: one a token it holds): their n-grams remembered, the branches
        updated. The device step's branch rows hand theirs back here (spd.drafters.selfdraft_device)."""
        for i, own in predicted.items():
            branch = self.branch[i]
            for k in range(self.gram - 2, len(branch)):   # G - 1 branch tokens ending at row k, and row k's prediction
                self.remember(branch[k - self.gram + 2: k + 1] + [own[k]])
            self.branch[i] = (branch + [own[-1]])[-self.length:]   # append the last prediction, drop the first past L

    def remember(self, gram: list[int], branch: bool = True) -> None:
        """A contextual n-gram into the LRU queue of its first token (branch: one the branches produced, counted in
        grams_added)."""
        queue = self.context.setdefault(gram[0], OrderedDict())
        cont = tuple(gram[1:])
        queue[cont] = queue.get(cont, 0) + 1
        queue.move_to_end(cont)
        self.grams_added += branch
        if len(queue) > self.lru:
            queue.popitem(last=False)

    def cached(self, root: int) -> list[tuple[tuple[int, ...], int]]:
        """The context cache's continuations of `root`, newest first, each with how often the branches produced it."""
        return list(reversed(self.context.get(root, {}).items()))


class SelfDraftDrafter(DraftBranches, Drafter):
    capabilities = frozenset({CHAIN, TREES, SIDE_ROWS, DEVICE_SIDE})

    def __init__(self, branches: int = 6, branch_length: int = 6, gram: int = 4,
                 corpus: CorpusNgrams | dict | None = None, candidates: int | None = None, lru: int = 16,
                 seed: int = 0, verified_ngrams: bool = True):
        DraftBranches.__init__(self, branches, branch_length, gram, lru, seed)
        self.verified_ngrams, self.seen = verified_ngrams, 0
        self.corpus = CorpusNgrams(corpus) if isinstance(corpus, dict) else corpus
        self.candidates = candidates or max(branches, 1)
        # the widest tree (every candidate apart, gram - 1 tokens each) and every branch row
        self.extra_rows = self.candidates * (gram - 1) + branches * branch_length
        self.tokens: list[int] = []

    def start(self, prompt_hidden, tokens) -> None:
        self.tokens = list(tokens)
        self.start_branches(self.tokens)
        self.seen = 0
        self.remember_verified()

    def observe(self, hidden, tokens) -> None:
        self.tokens = list(tokens)
        self.remember_verified()

    def remember_verified(self) -> None:
        """Every n-gram of the verified text not yet seen into the context cache (the prompt's at the start): text
        that repeats itself (code, a list) offers its own continuations, after the branches' of this cycle."""
        if not self.verified_ngrams:
            return
        tokens = self.tokens
        for i in range(max(0, self.seen - self.gram + 1), len(tokens) - self.gram + 1):
            self.remember(tokens[i: i + self.gram], branch=False)
        self.seen = len(tokens)

    def side_rows(self):
        return self.branch_rows() if self.n else None

    def side_logits(self, logits: torch.Tensor) -> None:
        self.branch_logits(logits)

    def device_side(self, device: torch.device) -> DeviceBranches | None:
        if not self.n:
            return None
        return DeviceBranches(self.n, self.length, device)

    def side_tokens(self) -> list[list[int]]:
        return self.branch

    def side_predictions(self, values: list[float]) -> None:
        """values: DeviceBranches' rows, L a branch, of which each branch's first len(branch) hold tokens."""
        rows, filled = self.length, len(self.branch[0])
        self.branch_predictions({i: [int(v) for v in values[i * rows: i * rows + filled]] for i in range(self.n)})

    def nodes(self, m: int, width: int, budget: int) -> int:
        return self.candidates * m if width == 1 else budget

    def candidate_list(self, root: int) -> list[tuple[int, ...]]:
        """The continuations keyed by the root: the context cache's, newest first, then the corpus's."""
        out = [cont for cont, _ in self.cached(root)]
        if self.corpus is not None and len(out) < self.candidates:
            for cont in self.corpus.lookup(self.tokens):
                if cont not in out:
                    out.append(cont)
        return out[:self.candidates]

    def propose(self, cycle: Cycle, choose=None) -> DraftTree:
        root, m, width, budget = cycle.root, cycle.m, cycle.width, cycle.budget
        if width == 1:       # W and tree_nodes not given: every candidate may branch off the root
            width, budget = self.candidates, self.candidates * m
        return merged_tree(root, (cont[:m] for cont in self.candidate_list(root)), width, budget, "selfdraft")


def chain_drafter(*, selfdraft: SelfDraftKeys, tokenizer, vocab_size: int) -> SelfDraftDrafter:
    """Self-Draft's drafter (spd.methods): its branches, branch length and gram, and with corpus_ngrams=true the
    tokenizer's corpus n-grams (none where no datastore can be built: the context cache alone)."""
    corpus = shared_corpus(tokenizer, vocab_size, selfdraft.gram) if selfdraft.corpus_ngrams else None
    return SelfDraftDrafter(selfdraft.branches, selfdraft.branch_length, selfdraft.gram, corpus,
                            verified_ngrams=selfdraft.verified_ngrams)


_CORPORA: dict[tuple[int, int, int], tuple[object, CorpusNgrams | None]] = {}


def shared_corpus(tokenizer, vocab_size: int, gram: int) -> CorpusNgrams | None:
    """corpus_ngrams, loaded once per tokenizer and gram in this process: every request's drafter (a server's, an
    eval's) reads the same counts. The tokenizer is kept beside them, so its id names it while they live."""
    key = (id(tokenizer), vocab_size, gram)
    if key not in _CORPORA:
        _CORPORA[key] = (tokenizer, corpus_ngrams(tokenizer, vocab_size, gram))
    return _CORPORA[key][1]
