"""The server's Prometheus metrics, under the names dashboards already read.

vLLM V1's speculative-decoding counters (`vllm:spec_decode_*`) are filled the way vLLM defines them: a *draft* is
one proposal the target verifies in one go, its *draft tokens* the tokens it proposed, *accepted tokens* those the
target kept, and `..._per_pos` counts acceptances by position inside a draft. SPD's pipeline verifies each drafted
token on its own (one draft of one token, position 0); a chain (lookup, EAGLE-3) proposes up to m tokens per cycle
(a cycle that proposed nothing — a lookup with no match — is no draft). The suite's own counters (steps K, tokens N, rollbacks, per draft source) give L′acc = n·N/K and τ."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from spd.metrics import ChainStats, DecodeStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, n: int):
        self.registry = r = CollectorRegistry()
        self.n = n
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Drafts verified", registry=r)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in their draft", ["position"], registry=r)
        self.tokens = Counter("spd_tokens", "Tokens generated (N)", registry=r)
        self.steps = Counter("spd_steps", "Pipeline steps (K) or chain cycles", registry=r)
        self.rollbacks = Counter("spd_rollbacks", "Rejected drafts that flushed the pipeline", registry=r)
        self.verified = Counter("spd_drafts_verified", "Drafts verified, by draft source", ["source"], registry=r)
        self.accepted = Counter("spd_drafts_accepted", "Drafts accepted, by draft source", ["source"], registry=r)
        self.eal = Gauge("spd_eal", "Equivalent acceptance length n*N/K pooled over every request so far (pipelined "
                         "methods; chains: tau, tokens per cycle)", registry=r)
        self.requests = Counter("spd_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("spd_request_seconds", "Request latency, enqueue to last token", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("spd_time_to_first_token_seconds", "Enqueue to the first verified token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("spd_queue_depth", "Requests waiting for the pipeline", registry=r)
        self.running = Gauge("spd_requests_running", "Requests decoding now (0 or 1)", registry=r)
        self._N = self._K = 0

    def decoded(self, stats: DecodeStats | ChainStats | None) -> None:
        """Count one finished (or cancelled) decode's record."""
        if stats is None:   # plain AR drafts nothing
            return
        self.tokens.inc(stats.N)
        for source, (verified, accepted) in stats.sources.items():
            self.verified.labels(source).inc(verified)
            self.accepted.labels(source).inc(accepted)
        if isinstance(stats, ChainStats):
            self.steps.inc(stats.cycles)
            self.num_drafts.inc(stats.drafting_cycles)   # a cycle that found nothing to propose drafted nothing
            self.num_draft_tokens.inc(stats.drafted)
            self.num_accepted_tokens.inc(stats.accepted)
            for accepted in stats.accepted_per_cycle:
                for pos in range(accepted):
                    self.accepted_per_pos.labels(str(pos)).inc()
            self._N, self._K = self._N + stats.N - 1, self._K + stats.cycles
            if self._K:
                self.eal.set(self._N / self._K)
            return
        verified = sum(v for v, _ in stats.sources.values())
        accepted = sum(a for _, a in stats.sources.values())
        self.steps.inc(stats.K)
        self.rollbacks.inc(stats.rollbacks)
        self.num_drafts.inc(verified)
        self.num_draft_tokens.inc(verified)
        self.num_accepted_tokens.inc(accepted)
        self.accepted_per_pos.labels("0").inc(accepted)
        self._N, self._K = self._N + stats.N, self._K + stats.K
        if self._K:
            self.eal.set(self.n * self._N / self._K)
