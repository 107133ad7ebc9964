"""`aiayn serve`'s Prometheus counters (`GET /metrics`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from aiayn.decoding.translate import Translation
from aiayn.deploy.engines import Backend

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------- metrics
class Metrics:
    """Prometheus counters of one server (its own registry: two apps in a process do not mix)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "aiayn_requests", "HTTP requests to /translate by status code", ["code"], registry=r
        )
        self.latency = Histogram(
            "aiayn_request_seconds",
            "time from a /translate request's arrival to its answer",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.batch_sentences = Histogram(
            "aiayn_batch_sentences",
            "sentences decoded together",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.queue = Gauge("aiayn_queue_sentences", "sentences waiting or decoding", registry=r)
        self.sentences = Counter("aiayn_sentences", "sentences translated", registry=r)
        self.out_tokens = Counter("aiayn_output_tokens", "output subwords generated", registry=r)
        self.tokens_per_s = Gauge(
            "aiayn_output_tokens_per_second",
            "output subwords per second of decoding, over the last 10 s of batches",
            registry=r,
        )
        self.disconnects = Counter(
            "aiayn_client_disconnects", "clients that left before their answer", registry=r
        )
        self._recent: deque[tuple[float, int, float]] = deque()  # (end, tokens, seconds)
        self._lock = threading.Lock()

    def batch_done(
        self, texts: list[str], results: list[list[Translation]], seconds: float, backend: Backend
    ) -> None:
        tokens = sum(backend.count_tokens(r[0].text) + 1 for r in results if r)  # + EOS
        self.batch_sentences.observe(len(texts))
        self.sentences.inc(len(texts))
        self.out_tokens.inc(tokens)
        now = time.perf_counter()
        with self._lock:
            self._recent.append((now, tokens, seconds))
            while self._recent and self._recent[0][0] < now - 10:
                self._recent.popleft()
            busy = sum(s for _, _, s in self._recent)
            self.tokens_per_s.set(sum(t for _, t, _ in self._recent) / busy if busy > 0 else 0.0)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
