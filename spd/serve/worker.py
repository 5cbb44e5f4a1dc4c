"""One pipeline, many clients: a FIFO of decode jobs run one at a time on the warm engine.

The HTTP side (asyncio, in its own thread) submits a `Job` and reads its events; `serve` runs in the process's main
thread — on these 2-core CPUs the same decode ran ~25% slower in a second thread than in the main one (lookup
chain, SmolLM2, 128 tokens: 11.4-12.3 s against 8.5-9.8 s) — and posts each released piece of text
back to the event loop. A job whose client went away, or whose text hit a stop string, has
its stream closed at the next verified token, which leaves the executor clean for the next job (spd.decoding).
With `max_batch` > 1, spd.serve.batching's worker runs up to that many jobs per forward (AR, the chains) or per
pipeline step (SPD's pipeline) instead; this one serves where nothing batches (streams, CUDA graphs)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from spd.decoding import Request
from spd.errors import PipelineFailure
from spd.runtimes import runtime
from spd.serve.metrics import ServerMetrics
from spd.serve.text import StopText


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class Job:
    prompt_ids: list[int]
    request: Request
    stop: tuple[str, ...]
    baseline: bool                      # decode with plain AR (per-request method=ar) instead of the engine's method
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)   # ("text", str) ... then ("done" | "error", dict)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    def post(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class DecodeWorker:
    def __init__(self, engine, metrics: ServerMetrics, max_queue: int, on_fatal=None):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.on_fatal = on_fatal            # called once a decode failed in a way the pipeline cannot survive
        self.failure: str | None = None     # that failure, for /health
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0
        self.current: Job | None = None
        self.mean_s = 1.0                   # running mean of a job's time, for Retry-After
        self.lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """A decode is running (/health)."""
        return self.current is not None

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.failure:
                raise PipelineFailure(self.failure)
            if self.waiting >= self.max_queue:
                raise QueueFull(max(1, round(self.mean_s * (self.waiting + 1))))
            self.waiting += 1
            self.metrics.queue_depth.set(self.waiting)
        self.jobs.put(job)

    def cancel_all(self) -> None:
        """Shutting down: answer what is queued with 503, stop what runs at its next token."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._dequeued()
                job.post("error", {"status": 503, "message": "the server is shutting down"})
        if self.current is not None:
            self.current.cancelled.set()

    def stop(self) -> None:
        """Cancel everything and make `serve` return."""
        self.cancel_all()
        self.jobs.put(None)

    def _dequeued(self) -> None:
        with self.lock:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)

    def serve(self, serving) -> None:
        """Run jobs in this thread, in order, while serving() is true (polled between jobs) or until `stop`."""
        while serving():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is None:
                return
            self._dequeued()
            if job.cancelled.is_set():
                continue
            if self.failure:
                job.post("error", {"status": 500, "message": self.failure})
                continue
            self.current = job
            self.metrics.running.set(1)
            try:
                self._run(job)
            finally:
                self.current = None
                self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        decoder = self.engine.baseline if job.baseline else self.engine.decoder
        text = StopText(self.engine.session.loaded.tokenizer, job.stop)
        tokens: list[int] = []
        start = time.perf_counter()
        first_at = None
        finish = "length"
        stream = decoder.stream(job.prompt_ids, job.request)
        try:
            for token in stream:
                if first_at is None:
                    first_at = time.perf_counter()
                    self.metrics.ttft.observe(first_at - job.enqueued)
                tokens.append(token)
                piece = text.push(token)
                if piece:
                    job.post("text", piece)
                if token in self.engine.session.eos_ids or text.stopped:
                    finish = "stop"
                if text.stopped or job.cancelled.is_set():
                    stream.close()   # at a verified token: the executor is left clean
                    break
        except Exception as exc:     # noqa: BLE001 - every failure is answered, and a dead pipeline ends the server
            stream.close()
            message = f"the decode failed: {exc}".splitlines()[0]
            fatal = isinstance(exc, PipelineFailure) or runtime(self.engine.session.spec.runtime.name).processes
            job.post("error", {"status": 500, "message": message})
            if fatal:
                self.failure = message
                if self.on_fatal:
                    self.on_fatal(message)
            return
        finally:
            self.metrics.decoded(decoder.stats)
        piece = text.finish()
        if piece:
            job.post("text", piece)
        seconds = time.perf_counter() - start
        self.mean_s = 0.8 * self.mean_s + 0.2 * (time.perf_counter() - job.enqueued)
        if job.cancelled.is_set() and not text.stopped:
            finish = "abort"   # vLLM's word: the server stopped it (shutdown); a client that left reads nothing
        job.post("done", {"token_ids": tokens, "finish_reason": finish, "stats": decoder.stats,
                          "seconds": seconds, "cancelled": job.cancelled.is_set()})
