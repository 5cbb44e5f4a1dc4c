"""Many requests decoded together: plain AR and the draft-then-verify chains (the context lookup, EAGLE-3), one
target forward per cycle over every running request's rows (spd.targets.ragged).

Each request is a `ChainSequence` — its own cache, drafter, sampling parameters, seed and statistics, exactly as
it would decode alone — and the batch only decides which sequences share a forward:

- admission is FIFO and continuous: a request waits until fewer than `max_batch` run, is prefilled alone (its
  prompt is already a wide forward) and joins the next cycle's forward;
- a cycle asks every running sequence for its rows (1 for AR, 1 + drafts for a chain), runs them as one ragged
  forward, and settles each sequence on its own logits;
- a finished (EOS, length) or cancelled request leaves before the next cycle, its cache freed.

What each request gets is its own decode: the batch changes only the rounding of the matrix products its rows share
(tests/test_batch.py compares every request's greedy tokens with its solo decode, and T = 1 distributions).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from spd.decoding import Decoder, Request
from spd.drafters.base import Drafter
from spd.runtime.sequence import ChainSequence
from spd.targets.ragged import Segment, few_rows_products, forward_segments
from spd.targets.row_costs import use_machine_products
from spd.targets.stages import StagedTarget


@dataclass(eq=False)
class Ticket:
    """One request in a batch: what it asked for, and what it has got so far."""
    prompt_ids: list[int]
    request: Request
    observe: Callable | None = None            # the sequence's observe (trace recording)
    on_tokens: Callable | None = None          # on_tokens(ticket, tokens): each cycle's verified tokens, as they settle
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None                  # "stop" (an end-of-sequence token), "length", "cancelled"
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None            # admitted (its prefill began)
    first_token_at: float | None = None
    finished_at: float | None = None
    sequence: object = None                    # the request's decode: a ChainSequence, or a pipeline's decoder
    _cancel: bool = False

    def cancel(self) -> None:
        """Leave at the next cycle (from any thread); tokens already verified stay in `tokens`."""
        self._cancel = True

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def stats(self):
        """The decode's statistics (ChainStats; a pipeline's DecodeStats)."""
        return self.sequence.stats if self.sequence else None

    @property
    def seconds(self) -> float:
        """From admission to the last token: the decode's own time (waiting excluded)."""
        end = self.finished_at or time.perf_counter()
        return end - self.started_at if self.started_at else 0.0


class ManySequences(Decoder):
    """What every decoder of many requests offers besides `submit` and `step`: run to the end, or one request as a
    stream (the others submitted to it advance in the same steps)."""
    waiting: deque
    running: list

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def abandon(self) -> None:
        """After a failed step: drop every request, running or waiting (their callers were answered)."""
        self.running.clear()
        self.waiting.clear()

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy:
            self.step()

    def stream(self, prompt_ids: list[int], request: Request) -> Iterator[int]:
        """One request's tokens; closing the stream cancels it."""
        ticket = self.submit(prompt_ids, request)
        self.stats = None
        sent = 0
        try:
            while True:
                if sent < len(ticket.tokens):
                    self.stats = ticket.stats
                    yield from ticket.tokens[sent:]
                    sent = len(ticket.tokens)
                if ticket.done:
                    return
                self.step()
        finally:
            if not ticket.done:
                ticket.cancel()


class BatchDecoder(ManySequences):
    def __init__(self, target: StagedTarget, eos_ids: frozenset[int], new_drafter: Callable[[], Drafter] | None
                 = None, m: int = 1, width: int = 1, budget: int | None = None, max_batch: int = 8,
                 capture=frozenset()):
        """new_drafter: a fresh drafter for each request (None: plain AR); m, width, budget: as ChainDecoder's;
        capture: target layers every sequence keeps for its observe (the trace recorder's)."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.target, self.eos_ids, self.new_drafter = target, eos_ids, new_drafter
        self.m, self.width, self.budget, self.max_batch = m, width, budget, max_batch
        self.capture = frozenset(capture)
        use_machine_products(target)            # a step's few rows, multiplied the faster way here
        self.waiting: deque[Ticket] = deque()
        self.running: list[Ticket] = []
        self.lock = threading.Lock()
        self.forwards = 0                       # batched forwards so far, and the rows they carried
        self.rows = 0

    def submit(self, prompt_ids: list[int], request: Request, observe=None, on_tokens=None) -> Ticket:
        ticket = Ticket(list(prompt_ids), request, observe, on_tokens)
        with self.lock:
            self.waiting.append(ticket)
        return ticket

    def _finish(self, ticket: Ticket, reason: str) -> None:
        ticket.finish = reason
        ticket.finished_at = time.perf_counter()
        if ticket.sequence is not None:
            ticket.sequence.cache = None        # the memory goes with the request

    def _deliver(self, ticket: Ticket, tokens: list[int]) -> None:
        if ticket.first_token_at is None:
            ticket.first_token_at = time.perf_counter()
        ticket.tokens.extend(tokens)
        if ticket.on_tokens:
            ticket.on_tokens(ticket, tokens)
        if ticket.sequence.done:
            self._finish(ticket, "stop" if tokens[-1] in self.eos_ids else "length")

    def _admit(self) -> None:
        while len(self.running) < self.max_batch:
            with self.lock:
                if not self.waiting:
                    return
                ticket = self.waiting.popleft()
            if ticket._cancel:
                self._finish(ticket, "cancelled")
                continue
            ticket.started_at = time.perf_counter()
            drafter = self.new_drafter() if self.new_drafter else None
            ticket.sequence = ChainSequence(self.target, drafter, self.eos_ids, ticket.prompt_ids, ticket.request,
                                            self.m, self.width, self.budget, self.capture, ticket.observe)
            self._deliver(ticket, ticket.sequence.prefill())
            if not ticket.done:
                self.running.append(ticket)

    @torch.no_grad()
    def step(self) -> None:
        """One cycle: the cancelled leave, the waiting are admitted, every running sequence advances once."""
        for ticket in self.running:
            if ticket._cancel and not ticket.done:
                self._finish(ticket, "cancelled")
        self.running = [t for t in self.running if not t.done]
        self._admit()
        if not self.running:
            return
        ids, segments = [], []
        for ticket in self.running:
            seq = ticket.sequence
            tree = seq.draft()
            ids.append(tree.tokens())
            segments.append(Segment.tree(seq.cache, seq.fed, tree))
        capture = frozenset().union(*(t.sequence.capture for t in self.running))
        hidden, captured, bounds = forward_segments(self.target, ids, segments, capture)
        with few_rows_products():
            logits = self.target.logits(hidden[0])             # [R, V]: one head product for every row
        self.forwards += 1
        self.rows += bounds[-1]
        for ticket, lo, hi in zip(self.running, bounds, bounds[1:]):
            seq = ticket.sequence
            own = {layer: captured[layer][:, lo:hi] for layer in seq.capture}
            self._deliver(ticket, seq.settle(logits[lo:hi], own))
        self.running = [t for t in self.running if not t.done]
