"""The server's decode loop when requests share forwards (`max_batch` > 1): up to `max_batch` jobs
run together — AR and the chains in one `BatchDecoder` (spd.runtime.batch), a pipelined method's in one
`SeedDecoder` (spd.runtime.seed), per-request method=ar beside them in a batch of its own — admitted FIFO from the same queue as the one-at-a-time
worker (and refused with 429 beyond `max_queue`, as there). Each job's tokens go through its own stop strings and
out to its own client as they settle; a job whose client left, whose text hit a stop string, or that shutdown
cancels leaves the batch at the next cycle, and the others go on."""

from __future__ import annotations

import queue
import time

from spd.errors import PipelineFailure
from spd.runtimes import runtime
from spd.serve.text import StopText
from spd.serve.worker import DecodeWorker, Job


class Running:
    """One job inside the batch: its text so far and the tokens its client has been sent."""

    def __init__(self, job: Job, tokenizer):
        self.job, self.text = job, StopText(tokenizer, job.stop)
        self.tokens: list[int] = []
        self.first_at: float | None = None


class BatchWorker(DecodeWorker):
    def __init__(self, engine, metrics, max_queue: int, batch, plain=None, on_fatal=None):
        """batch: the engine's method, batched (BatchDecoder or SeedDecoder); plain: batched AR for requests that ask
        for method=ar (None: `batch` is AR already). The two step in turn; max_batch counts both."""
        super().__init__(engine, metrics, max_queue, on_fatal)
        self.batch = batch
        # no batched AR beside a pipeline in stage processes (runtime=distributed): its AR relays one request
        self.plain = plain if plain is not None else batch if engine.session.spec.method == "ar" else None
        self.max_batch = batch.max_batch
        self.running: dict = {}                 # ticket -> Running

    def cancel_all(self) -> None:
        super().cancel_all()
        for run in self.running.values():
            run.job.cancelled.set()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def serve(self, serving) -> None:
        """Admit, step, answer, while serving() is true or jobs are in flight, or until `stop`."""
        stopping = False
        while (serving() and not stopping) or self.running:
            stopping = self._admit(block=not self.running) or stopping
            for ticket, run in self.running.items():
                if run.job.cancelled.is_set():
                    ticket.cancel()
            if not self.running:
                continue
            self.metrics.running.set(len(self.running))
            try:
                for decoder in {id(d): d for d in (self.batch, self.plain) if d is not None}.values():
                    if decoder.busy:
                        decoder.step()
            except Exception as exc:     # noqa: BLE001 - every job in the batch is answered
                self._fail(exc)
                continue
            for ticket in [t for t in self.running if t.done]:
                self._answer(ticket, self.running.pop(ticket))
            self.metrics.running.set(len(self.running))
        self.metrics.running.set(0)

    def _admit(self, block: bool) -> bool:
        """Move queued jobs into the batch while it has room; True when `stop` was asked."""
        while len(self.running) < self.max_batch:
            try:
                job = self.jobs.get(timeout=0.1) if block else self.jobs.get_nowait()
            except queue.Empty:
                return False
            if job is None:
                return True
            self._dequeued()
            block = False
            if job.cancelled.is_set():
                continue
            if self.failure:
                job.post("error", {"status": 500, "message": self.failure})
                continue
            run = Running(job, self.engine.session.loaded.tokenizer)
            ticket = (self.plain if job.baseline else self.batch).submit(job.prompt_ids, job.request,
                                                                         on_tokens=self._on_tokens)
            self.running[ticket] = run
        return False

    def _on_tokens(self, ticket, tokens: list[int]) -> None:
        run = self.running[ticket]
        if run.first_at is None:
            run.first_at = time.perf_counter()
            self.metrics.ttft.observe(run.first_at - run.job.enqueued)
        for token in tokens:
            if run.text.stopped:
                break                            # the stop string ended the text inside this cycle's tokens
            run.tokens.append(token)
            piece = run.text.push(token)
            if piece:
                run.job.post("text", piece)
        if run.text.stopped:
            ticket.cancel()

    def _answer(self, ticket, run: Running) -> None:
        stats = None if run.job.baseline or self.engine.session.spec.method == "ar" else ticket.stats
        self.metrics.decoded(stats)
        piece = run.text.finish()
        if piece:
            run.job.post("text", piece)
        eos = bool(run.tokens) and run.tokens[-1] in self.engine.session.eos_ids
        finish = "stop" if run.text.stopped or eos else "length"
        if ticket.finish == "cancelled" and not run.text.stopped:
            finish = "abort"
        self.mean_s = 0.8 * self.mean_s + 0.2 * (time.perf_counter() - run.job.enqueued)
        run.job.post("done", {"token_ids": run.tokens, "finish_reason": finish, "stats": stats,
                              "seconds": ticket.seconds, "cancelled": run.job.cancelled.is_set()})

    def _fail(self, exc: Exception) -> None:
        """Every job in the batch is answered 500; a dead pipeline (stage processes) ends the server, as the
        one-at-a-time worker's does."""
        message = f"the decode failed: {exc}".splitlines()[0]
        for ticket, run in self.running.items():
            ticket.cancel()
            run.job.post("error", {"status": 500, "message": message})
        self.running.clear()
        for decoder in filter(None, (self.batch, self.plain)):
            decoder.abandon()
        if isinstance(exc, PipelineFailure) or runtime(self.engine.session.spec.runtime.name).processes:
            self.failure = message
            if self.on_fatal:
                self.on_fatal(message)
