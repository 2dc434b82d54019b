"""Every Prometheus metric of a worker, in one object built from a registry
(tests pass a fresh ``CollectorRegistry``). Base units, ``_total`` counters,
``_seconds`` histograms; labels are low-cardinality only (never a run, event,
tenant or node id). Meanings are in ``docs/metrics.md``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from alma_core.storage.observer import LATENCY_BUCKETS, CacheResult, ReadMetrics

E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def _process_collectors(registry: CollectorRegistry) -> None:
    """process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds... in a
    registry of our own (the default registry has them already)."""
    if registry is not REGISTRY:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        _process_collectors(r)
        self._batches(r)
        self._consumers(r)
        # the read side's families (a process that serves reads reports them here too)
        self.reads = ReadMetrics(r)
        self.embedded = EmbeddedMetrics(r)  # set by `alma up` only
        self.cache = self.reads.cache
        self.retrieval_seconds = self.reads.retrieval_seconds
        self._merges_and_outbox(r)
        self._learning(r)

    def _batches(self, r: CollectorRegistry) -> None:
        """Every consumer's records and batches: outcomes, dead letters, checkpoints, times."""
        self.events = Counter(
            "alma_events_total",
            "Events consumed, by consumer, event type and outcome",
            ["consumer", "type", "outcome"],
            registry=r,
        )
        self.duplicates = Counter(
            "alma_duplicates_total",
            "Events skipped because their event_id or offset was already applied",
            ["consumer"],
            registry=r,
        )
        self.read_again = Counter(
            "alma_batches_read_again_total",
            "Batches whose reads were stale and were read again: a lock waited on that "
            "another transaction committed through, or, for a batch read without locks, a "
            "run or offset its write found changed (then applied under the runs' locks)",
            ["consumer"],
            registry=r,
        )
        self.batch_writes = Counter(
            "alma_batch_writes_total",
            "Checkpointer batches applied, by path: remembered (folded from memory, one "
            "round trip), unlocked (read without locks, then one checked statement "
            "committing alone) or locked (a transaction under the runs' locks)",
            ["consumer", "path"],
            registry=r,
        )
        self.dead_letters = Counter(
            "alma_dead_letters_total",
            "Records sent to the dead-letter topic, by reason",
            ["consumer", "reason"],
            registry=r,
        )
        self.tenant_refusals = Counter(
            "alma_tenant_refused_total",
            "Events refused because their topic's tenant (who produced them) may not do "
            "what they ask: claim another tenant, or answer on another tenant's topic "
            "(ALMA_TENANT_TOPICS); by the producing tenant and reason",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_throttled = Counter(
            "alma_tenant_throttled_total",
            "Times a tenant's partitions were paused for its rate quota (its events "
            "delayed, never dropped)",
            ["tenant"],
            registry=r,
        )
        self.tenant_events = Counter(
            "alma_tenant_events_total",
            "Events of each tenant handed to the checkpointer (ALMA_TENANT_TOPICS)",
            ["tenant"],
            registry=r,
        )
        self.tenant_storage = Gauge(
            "alma_tenant_storage_bytes",
            "Bytes of checkpoint states each tenant keeps (the count its storage quota is "
            "held to), read by the checkpointer every few seconds",
            ["tenant"],
            registry=r,
        )
        self.tenant_storage_quota = Gauge(
            "alma_tenant_storage_quota_bytes",
            "Each tenant's storage quota in effect (its own, else "
            "ALMA_TENANT_STORAGE_QUOTA_BYTES; 0: none)",
            ["tenant"],
            registry=r,
        )
        self.runs_blocked = Gauge(
            "alma_runs_blocked",
            "Running runs of each tenant that wait on a dead letter of one of their events "
            "(not replayed, not applied since, the run not advanced since), read by the "
            "checkpointer every few seconds",
            ["tenant"],
            registry=r,
        )
        self.tenant_storage_refused = Counter(
            "alma_tenant_storage_refused_total",
            "Events refused because their tenant was at its storage quota (a new run's, or "
            "a run refused so before): dead-lettered as storage_quota, replayable",
            ["tenant"],
            registry=r,
        )
        self.dead_letter_failures = Counter(
            "alma_dead_letter_failures_total",
            "Records whose dead-letter row could not be stored: skipped, sent to the "
            "dead-letter topic directly and logged whole (an alert fires)",
            ["consumer"],
            registry=r,
        )
        self.checkpoints = Counter(
            "alma_checkpoints_total", "Checkpoints written", ["consumer", "kind"], registry=r
        )
        self.batch_seconds = Histogram(
            "alma_batch_seconds",
            "Time to process one polled batch, end to end",
            ["consumer"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "alma_batch_records",
            "Records per processed batch",
            ["consumer"],
            buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000),
            registry=r,
        )
        self.transaction_seconds = Histogram(
            "alma_checkpoint_write_seconds",
            "PostgreSQL transaction time of one batch",
            ["consumer"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "alma_end_to_end_lag_seconds",
            "Time from emitted_at to durable, per event",
            ["consumer", "type"],
            buckets=E2E_BUCKETS,
            registry=r,
        )

    def _consumers(self, r: CollectorRegistry) -> None:
        """The Kafka side of a consumer: commits, lag, offsets, rebalances, polls, GC pauses."""
        self.commit_seconds = Histogram(
            "alma_offset_commit_seconds",
            "Kafka offset commit time",
            ["consumer"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_failures = Counter(
            "alma_offset_commit_failures_total",
            "Failed Kafka offset commits",
            ["consumer"],
            registry=r,
        )
        self.storage_retries = Counter(
            "alma_storage_retries_total",
            "Batches retried because PostgreSQL was unavailable",
            ["consumer"],
            registry=r,
        )
        self.lag = Gauge(
            "alma_consumer_lag",
            "High watermark minus committed offset, per partition",
            ["consumer", "topic", "partition"],
            registry=r,
        )
        self.offsets_skipped = Counter(
            "alma_offsets_skipped_total",
            "Offsets of the log that held no record when read (transaction markers, records "
            "removed by retention or compaction): moved past",
            ["consumer"],
            registry=r,
        )
        self.offsets_ahead_of_log = Gauge(
            "alma_offsets_ahead_of_log",
            "Records this group applied beyond the end of the broker's log (the broker "
            "lost or replaced it): the partition is paused until `alma offsets reset`",
            ["consumer", "topic", "partition"],
            registry=r,
        )
        self.gc_pause_seconds = Histogram(
            "alma_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, by generation: the worker's event "
            "loop (every consumer in the process) stands still meanwhile",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.assigned_partitions = Gauge(
            "alma_assigned_partitions",
            "Partitions assigned to this worker",
            ["consumer"],
            registry=r,
        )
        self.rebalances = Counter(
            "alma_rebalances_total", "Group rebalances seen", ["consumer"], registry=r
        )
        self.consumer_restarts = Counter(
            "alma_consumer_restarts_total",
            "Consumers this worker replaced with a new one (reason: starved, a partition "
            "not fetched though its log holds more)",
            ["consumer", "reason"],
            registry=r,
        )
        self.last_poll = Gauge(
            "alma_last_poll_timestamp_seconds",
            "Unix time of the last successful poll",
            ["consumer"],
            registry=r,
        )

    def _merges_and_outbox(self, r: CollectorRegistry) -> None:
        """The joiner's merges and the outbox's publishing."""
        self.merges = Counter(
            "alma_merges_total",
            "Join requests answered, by outcome (ok, error, duplicate; handoff_lost: not "
            "answered, its hand-off came from a commit a failover lost)",
            ["outcome"],
            registry=r,
        )
        self.merge_seconds = Histogram(
            "alma_merge_seconds",
            "Time to load the branch heads and merge them, per join",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.outbox_published = Counter(
            "alma_outbox_published_total",
            "Outbox records published, by topic kind",
            ["kind"],
            registry=r,
        )
        self.outbox_failures = Counter(
            "alma_outbox_failures_total", "Outbox publish attempts that failed", registry=r
        )

    def _learning(self, r: CollectorRegistry) -> None:
        """The learner: embeddings, outcomes, memories, retention."""
        self.embeddings = Counter(
            "alma_embeddings_total",
            "Texts embedded, by result (encoded, cached)",
            ["result"],
            registry=r,
        )
        self.embed_batch = Histogram(
            "alma_embedding_batch_size",
            "Texts per model call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.embed_seconds = Histogram(
            "alma_embedding_seconds",
            "Time of one model call (a batch of texts)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.outcomes = Counter(
            "alma_outcomes_total",
            "Workflow outcomes, by result (stored, duplicate, not_learned)",
            ["result"],
            registry=r,
        )
        self.memories = Counter(
            "alma_memories_written_total",
            "Memories written or updated by the learner, by kind",
            ["kind"],
            registry=r,
        )
        self.checkpoints_pruned = Counter(
            "alma_checkpoints_pruned_total",
            "Checkpoints deleted by cleanup after learning or by retention",
            ["reason"],
            registry=r,
        )
        self.rows_pruned = Counter(
            "alma_rows_pruned_total",
            "Rows deleted by retention, by table group",
            ["table"],
            registry=r,
        )

    # ReadObserver: a process that runs workers and serves reads (the demo) reports both
    def cache_read(self, result: CacheResult) -> None:
        self.reads.cache_read(result)

    def retrieval(self, scope: str, plan: str, seconds: float) -> None:
        self.reads.retrieval(scope, plan, seconds)

    def forget_partition(self, consumer: str, topic: str, partition: int) -> None:
        """Drop the per-partition series of a revoked partition (no ghosts on dashboards)."""
        for gauge in (self.lag, self.offsets_ahead_of_log):
            with contextlib.suppress(KeyError):
                gauge.remove(consumer, topic, str(partition))


class EmbeddedMetrics:
    """What ``alma up`` reports of its embedded services (empty in other workers)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.restarts = Counter(
            "alma_embedded_restarts_total",
            "Embedded services restarted by `alma up` after they died",
            ["service"],
            registry=r,
        )
        self.memory = Gauge(
            "alma_embedded_memory_bytes",
            "Memory an embedded service holds (its processes' proportional set size)",
            ["service"],
            registry=r,
        )
        self.log_records = Gauge(
            "alma_embedded_log_records",
            "Records the embedded broker keeps in a partition (it keeps every one, in memory)",
            ["topic", "partition"],
            registry=r,
        )


class ExporterMetrics:
    """What ``alma lag-exporter`` exports: the broker's view of the ALMA groups, under
    kafka_exporter's names (its dashboards, alerts and KEDA triggers work unchanged),
    plus the exporter's own health."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        _process_collectors(r)
        self.partition_offset = Gauge(
            "kafka_topic_partition_current_offset",
            "Where the partition ends (the offset the next record gets)",
            ["topic", "partition"],
            registry=r,
        )
        self.group_offset = Gauge(
            "kafka_consumergroup_current_offset",
            "The group's committed offset in the partition",
            ["consumergroup", "topic", "partition"],
            registry=r,
        )
        self.lag = Gauge(
            "kafka_consumergroup_lag",
            "Records the group has not yet committed past, per partition",
            ["consumergroup", "topic", "partition"],
            registry=r,
        )
        self.lag_sum = Gauge(
            "kafka_consumergroup_lag_sum",
            "Records the group has not yet committed past, over the topic",
            ["consumergroup", "topic"],
            registry=r,
        )
        self.members = Gauge(
            "kafka_consumergroup_members",
            "Members of the group (0: nothing consumes)",
            ["consumergroup"],
            registry=r,
        )
        self.last_success = Gauge(
            "alma_lag_exporter_last_success_timestamp_seconds",
            "When the broker last answered every question of a scrape (Unix time)",
            registry=r,
        )
        self.errors = Counter(
            "alma_lag_exporter_errors_total", "Scrapes of the broker that failed", registry=r
        )
        self.scrape_seconds = Histogram(
            "alma_lag_exporter_scrape_seconds",
            "Time to read the groups' offsets and the partitions' ends",
            registry=r,
        )


@contextlib.contextmanager
def gc_pauses(metrics: Metrics) -> Iterator[None]:
    """Time every collection of Python's cyclic garbage collector into
    ``alma_gc_pause_seconds`` while the block runs (a callback of the ``gc`` module:
    process-wide, one clock read at each start and stop)."""
    started = [0.0]

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pause = time.perf_counter() - started[0]
            metrics.gc_pause_seconds.labels(str(info["generation"])).observe(pause)

    gc.callbacks.append(on_collection)
    try:
        yield
    finally:
        gc.callbacks.remove(on_collection)
