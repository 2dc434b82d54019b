"""What the read side reports, and where: one interface for every process that serves
reads (the SDK in an orchestrator, the demo, ``alma mcp``), one Prometheus
implementation, and the same metric families a worker exports.

* :class:`ReadObserver` is what :class:`~alma_core.storage.reader.CheckpointReader`
  and :class:`~alma_core.storage.retrieval.Retriever` call: a cache lookup's result
  (``hit``, ``miss``, ``error``) and a retrieval's time by scope and plan.
* :class:`ReadMetrics` records them as ``alma_cache_operations_total{result}`` and
  ``alma_retrieval_seconds{scope,plan}`` (the dashboard's cache hit ratio and
  retrieval p95). A worker's ``Metrics`` holds one too, so cache writes (``write``,
  ``write_error``) and reads land in one family.
* :meth:`ReadMetrics.shared` registers them once per process in prometheus-client's
  default registry, where a host process already exposes its own metrics.
"""

from __future__ import annotations

import threading
from collections import Counter as Tallies
from typing import ClassVar, Literal, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

CacheResult = Literal["hit", "miss", "error"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ReadObserver(Protocol):
    def cache_read(self, result: CacheResult) -> None:
        """One cache lookup: ``hit``, ``miss`` (PostgreSQL answers) or ``error`` (Redis
        failed; PostgreSQL answers)."""

    def retrieval(self, scope: str, plan: str, seconds: float) -> None:
        """One scoped retrieval, the query's embedding included."""


class NoObserver:
    """Reports nothing (benchmarks that time the reads themselves)."""

    def cache_read(self, result: CacheResult) -> None:
        pass

    def retrieval(self, scope: str, plan: str, seconds: float) -> None:
        pass


class Tally:
    """Counts what one reader saw (``alma resume --json`` says where its answer came
    from), and passes everything on to ``forward``."""

    def __init__(self, forward: ReadObserver | None = None) -> None:
        self.counts: Tallies[str] = Tallies()
        self.forward = forward or NoObserver()

    def cache_read(self, result: CacheResult) -> None:
        self.counts[f"cache_{result}"] += 1
        self.forward.cache_read(result)

    def retrieval(self, scope: str, plan: str, seconds: float) -> None:
        self.counts["retrieval"] += 1
        self.forward.retrieval(scope, plan, seconds)


class ReadMetrics:
    """The read side's Prometheus metrics, in ``registry``."""

    _shared: ClassVar[ReadMetrics | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.cache = Counter(
            "alma_cache_operations_total",
            "Redis cache operations, by result (hit, miss, error, write, write_error)",
            ["result"],
            registry=registry,
        )
        self.retrieval_seconds = Histogram(
            "alma_retrieval_seconds",
            "Time of one scoped retrieval, embedding included",
            ["scope", "plan"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    @classmethod
    def shared(cls) -> ReadMetrics:
        """This process's read metrics in the default registry (created once)."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(REGISTRY)
            return cls._shared

    def cache_read(self, result: CacheResult) -> None:
        self.cache.labels(result).inc()

    def retrieval(self, scope: str, plan: str, seconds: float) -> None:
        self.retrieval_seconds.labels(scope, plan).observe(seconds)
