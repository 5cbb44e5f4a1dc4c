"""A datastore of text to draft from (retrieval drafting, REST's idea — continuations of the context's suffix looked
up in a corpus — not its code): a token corpus and its suffix array, so every earlier occurrence anywhere in the
corpus of the context's last n tokens is one contiguous range of the array.

The array sorts the suffixes of the **reversed** corpus, and the context is read backwards: the range that matches the
last k + 1 tokens lies inside the range that matches the last k, so the longest match is found by narrowing one token
at a time (two binary searches a token, no n-gram tables), and the longest match of any length up to `max_n` costs
what a few dictionary probes do. A continuation is what followed an occurrence in the forward corpus, read backwards
from where the occurrence ends in the reversed one; it stops at the separator between two documents.

Built from the ShareGPT conversations' assistant turns or the target's own answers (spd.corpora.retrieval), or from any token
sequences (`Datastore.build`); several are read in turn as one (`Stores`). The datastore only chooses what is drafted;
verification decides what is output, so no datastore can change a decoded token (tests/test_datastore.py).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os

import numpy as np

FORMAT = 2


class Datastore:
    """reversed: the corpus back to front (int32, `separator` between documents); order: its suffix array."""

    def __init__(self, reversed_tokens: np.ndarray, order: np.ndarray, separator: int, meta: dict | None = None,
                 first: np.ndarray | None = None):
        self.rev, self.order, self.separator = reversed_tokens, order, separator
        self.meta = meta or {}
        # first[t]: where the suffixes starting with token t begin in the array, so the first narrowing is a lookup
        self.first = first if first is not None else \
            np.searchsorted(reversed_tokens[order], np.arange(separator + 2), side="left").astype(np.int64)

    def __len__(self) -> int:
        return len(self.rev)

    @classmethod
    def build(cls, documents, vocab_size: int, meta: dict | None = None) -> "Datastore":
        """documents: token sequences (ids < vocab_size), joined with a separator (= vocab_size) between them."""
        from pydivsufsort import divsufsort

        pieces = []
        for doc in documents:
            pieces.append(np.asarray(doc, dtype=np.int32))
            pieces.append(np.array([vocab_size], dtype=np.int32))
        corpus = np.concatenate(pieces) if pieces else np.array([vocab_size], dtype=np.int32)
        if corpus.min() < 0 or corpus.max() > vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        reversed_tokens = np.ascontiguousarray(corpus[::-1])
        return cls(reversed_tokens, divsufsort(reversed_tokens).astype(np.int32), vocab_size, meta)

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """Inside [lo, hi), whose suffixes share their first `depth` tokens, those whose next token is `token`."""
        rev, order, end = self.rev, self.order, len(self.rev)

        def key(i: int) -> int:           # a suffix that ends before depth sorts first
            at = int(order[i]) + depth
            return int(rev[at]) if at < end else -1
        rows = range(len(order))
        return bisect.bisect_left(rows, token, lo, hi, key=key), bisect.bisect_right(rows, token, lo, hi, key=key)

    def match(self, context: list[int], max_n: int) -> tuple[int, int, int]:
        """(n, lo, hi): the longest suffix of `context` (n <= max_n tokens) that occurs in the corpus, and the range
        of its occurrences in the array; n = 0 when not even the last token occurs."""
        if not context or not 0 <= context[-1] < self.separator:
            return 0, 0, 0
        token = context[-1]
        lo, hi = int(self.first[token]), int(self.first[token + 1])
        if lo == hi:
            return 0, 0, 0
        n = 1
        while n < min(max_n, len(context)) and 0 <= context[-1 - n] < self.separator:
            nlo, nhi = self._narrow(lo, hi, n, context[-1 - n])
            if nlo == nhi:
                break
            lo, hi, n = nlo, nhi, n + 1
        return n, lo, hi

    def continuations(self, context: list[int], max_n: int, min_n: int, limit: int, length: int
                      ) -> tuple[int, list[list[int]]]:
        """(n, continuations): up to `limit` occurrences of the longest matching suffix (n >= min_n tokens; spread
        evenly over its range, so a frequent phrase is represented by a fixed sample), each with the up to `length`
        tokens that followed it, cut at a document's end."""
        n, lo, hi = self.match(context, max_n)
        if n < min_n:
            return 0, []
        picks = np.unique(np.linspace(lo, hi - 1, min(limit, hi - lo)).astype(np.int64))
        out = []
        for end in self.order[picks].tolist():
            # the occurrence covers rev[end : end + n]; what followed it forward is rev[end - 1], rev[end - 2], ...
            following = self.rev[max(end - length, 0): end][::-1].tolist()
            if self.separator in following:
                following = following[: following.index(self.separator)]
            if following:
                out.append(following)
        return n, out

    def save(self, path: str) -> None:
        """One safetensors file, written whole or not at all."""
        from safetensors.numpy import save_file

        tmp = path + ".tmp"
        save_file({"reversed": self.rev, "order": self.order, "first": self.first}, tmp,
                  metadata={"format": str(FORMAT), "separator": str(self.separator), "meta": json.dumps(self.meta)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Datastore":
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as f:
            header = f.metadata() or {}
            if header.get("format") != str(FORMAT):
                raise ValueError(f"{path}: not a datastore of format {FORMAT}")
            return cls(f.get_tensor("reversed"), f.get_tensor("order"), int(header["separator"]),
                       json.loads(header.get("meta", "{}")), f.get_tensor("first"))


def tokenizer_key(tokenizer) -> str:
    """What a datastore's ids mean: the tokenizer's vocabulary, hashed."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:20]


def save_documents(path: str, documents, meta: dict) -> None:
    """The documents alone — their ids (uint16 where every id fits) and lengths — as one safetensors file, written
    whole or not at all: small enough to ship in the package; `load_documents` + `Datastore.build` sorts them again
    (about a second a million tokens)."""
    from safetensors.numpy import save_file

    lengths = np.array([len(doc) for doc in documents], dtype=np.int64)
    ids = np.concatenate([np.asarray(doc, dtype=np.int64) for doc in documents]) if documents else np.zeros(0, np.int64)
    ids = ids.astype(np.uint16 if ids.size == 0 or ids.max() < 2 ** 16 else np.int32)
    tmp = path + ".tmp"
    save_file({"ids": ids, "lengths": lengths}, tmp, metadata={"format": f"documents-{FORMAT}",
                                                              "meta": json.dumps(meta)})
    os.replace(tmp, path)


def load_documents(path: str) -> tuple[list[np.ndarray], dict]:
    """(documents, meta) of a file `save_documents` wrote."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        header = f.metadata() or {}
        if header.get("format") != f"documents-{FORMAT}":
            raise ValueError(f"{path}: not a documents file of format {FORMAT}")
        ids, lengths = f.get_tensor("ids").astype(np.int32), f.get_tensor("lengths")
    return np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else [], json.loads(header.get("meta", "{}"))


class Stores:
    """Several datastores read as one, in order: the first's occurrences of its longest match, then the next's up to
    `limit` in all (so a small corpus of the target's own answers speaks first and a large one fills in); the match
    length reported is the longest any of them found."""

    def __init__(self, stores: list[Datastore]):
        self.stores = list(stores)

    def __len__(self) -> int:
        return sum(len(store) for store in self.stores)

    def continuations(self, context: list[int], max_n: int, min_n: int, limit: int, length: int
                      ) -> tuple[int, list[list[int]]]:
        longest, out = 0, []
        for store in self.stores:
            if len(out) >= limit:
                break
            n, following = store.continuations(context, max_n, min_n, limit - len(out), length)
            longest, out = max(longest, n), out + following
        return longest, out
