"""Context-lookup drafts (prompt-lookup decoding; the n-gram half of Multi-Branch Self-Drafting): the next tokens
are what followed, earlier in the context (prompt + verified tokens), the longest suffix of the context that
occurred before. No model and no logits: each draft is a deterministic proposal (q = None), which sampled
verification accepts with probability p(x) (spd.verify.sampling.verify_point_mass), so the output stays the target's.

The index is a pool of n-grams kept incrementally: appending a token adds the n-grams that end just before it, each
mapped to where its continuation starts (the newest occurrence wins, and remembers the one it replaced), so a
lookup is one dictionary probe per n-gram size and nothing is rescanned per step.

W > 1 drafts a tree (design §8): the continuations of several earlier matches — the longest suffix's newest
occurrences first, then shorter suffixes' — merged as a trie where they agree and branching where they do not (at
most W children a node, `budget` nodes in all). Every candidate is deterministic, so verification keeps each with its
p (`spd.verify.sampling.settle_children`).
"""

from __future__ import annotations

from spd.drafters.base import CHAIN, TREES, Cycle, Drafter, merged_tree
from spd.verify.sampling import Proposal
from spd.spec import LookupOptions
from spd.verify.tree import DraftTree


class NgramIndex:
    """tokens, and for each n in min_n..max_n: {n-gram: index after its newest earlier occurrence}."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes {min_n}..{max_n}: need 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.older: dict[tuple[int, int], int] = {}   # (n, start) -> the start of the occurrence it replaced
        # per token: the (n, n-gram, previous entry) its append overwrote, so drafts can be taken back
        self.undo: list[list[tuple[int, tuple[int, ...], int | None]]] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # n-grams ending at the current last token now have a continuation: the token being appended
            end = len(self.tokens)
            changes = []
            for n, table in self.tables.items():
                if end >= n:
                    gram = tuple(self.tokens[end - n: end])
                    previous = table.get(gram)
                    changes.append((n, gram, previous))
                    table[gram] = end
                    if previous is not None:
                        self.older[(n, end)] = previous
            self.tokens.append(token)
            self.undo.append(changes)

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (drafts a rejection flushed), restoring the pool as it was."""
        while len(self.tokens) > length:
            self.tokens.pop()
            end = len(self.tokens)
            for n, gram, previous in reversed(self.undo.pop()):
                self.older.pop((n, end), None)
                if previous is None:
                    del self.tables[n][gram]
                else:
                    self.tables[n][gram] = previous

    def match(self) -> tuple[int, int]:
        """(n, start) for the longest suffix of the tokens that occurred earlier, with `start` the index of the
        token that followed that occurrence; (0, -1) when no suffix of at least min_n tokens did."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(self.tokens[length - n:]))
            if start is not None:
                return n, start
        return 0, -1

    def matches(self, limit: int) -> list[int]:
        """Up to `limit` distinct continuation starts: the longest matching suffix's occurrences, newest first,
        then the next shorter suffix's, down to min_n."""
        length, out = len(self.tokens), []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(self.tokens[length - n:]))
            while start is not None and len(out) < limit:
                if start not in out:
                    out.append(start)
                start = self.older.get((n, start))
            if len(out) == limit:
                break
        return out

    def continuation(self, start: int, count: int) -> list[int]:
        """`count` tokens copied from `start` on; past the end the copy reads its own output (a loop repeats)."""
        out = []
        length = len(self.tokens)
        for k in range(count):
            i = start + k
            out.append(self.tokens[i] if i < length else out[i - length])
        return out


class LookupDrafter(Drafter):
    """Up to m drafts per cycle: the continuation of the longest earlier match of the context's suffix (at least
    min_n tokens long, at most max_n are compared); no match, no drafts (the cycle is a plain AR step)."""

    capabilities = frozenset({CHAIN, TREES})

    def __init__(self, min_n: int = 2, max_n: int = 8):
        self.min_n, self.max_n = min_n, max_n
        self.last_match = 0       # length of the suffix match behind the newest drafts (0: none)

    def start(self, prompt_hidden, tokens) -> None:
        self.index = NgramIndex(self.min_n, self.max_n)
        self.index.extend(tokens)

    def observe(self, hidden, tokens) -> None:
        self.index.extend(tokens[len(self.index):])

    def chain(self, m: int) -> list[Proposal]:
        """The chain's drafts: up to m tokens of the longest match's continuation."""
        n, start = self.index.match()
        self.last_match = n
        return [Proposal(token, source="lookup") for token in self.index.continuation(start, m)] if n else []

    def propose(self, cycle: Cycle, choose=None) -> DraftTree:
        root, m, width, budget = cycle.root, cycle.m, cycle.width, cycle.budget
        if width == 1:
            return DraftTree.chain(root, self.chain(m))
        self.last_match = self.index.match()[0]
        return merged_tree(root, (self.index.continuation(start, m) for start in self.index.matches(budget)), width,
                           budget, "lookup")


def chain_drafter(*, lookup: LookupOptions) -> LookupDrafter:
    """The context lookup's drafter (spd.methods): suffixes of lookup_min_ngram..lookup_max_ngram tokens matched
    earlier."""
    return LookupDrafter(lookup.min_ngram, lookup.max_ngram)
