"""The consumer runtime shared by every consumer group: poll, hand a batch to the
handler, retry while storage is down, commit to Kafka after the handler's own
(database) commit, follow rebalances, drain and leave on shutdown.

What the runtime guarantees the handler:
* batches arrive in partition order, one at a time (no overlap);
* Kafka offsets are committed after the handler's commit, batched in time, and
  what is pending when a poll comes back empty is committed then (they are a hint
  for fallbacks and lag exporters; the handler's stored offsets are the truth);
* on assignment, each partition starts where the handler says it stopped
  (offsets stored with the effects), falling back to Kafka's committed offset;
* a retriable :class:`errors.StorageError` pauses consumption and retries the
  same batch with backoff until it succeeds or the worker stops; nothing is
  skipped, and the heartbeat and poll keep the membership alive meanwhile;
* a partition whose log ends before the offset the handler already applied (the
  broker lost or replaced its log: a restart without its data, a new cluster with
  the same id) is paused and reported, never skipped silently: its records would
  otherwise look "already applied" (``alma_offsets_ahead_of_log``, an alert, and
  a log line that says to run ``alma offsets reset``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from alma_core import errors
from alma_core.storage.offsets import PartitionKey
from consumers.metrics import Metrics

log = logging.getLogger("alma.consumers")


@dataclass
class HandleResult:
    next_offsets: dict[PartitionKey, int] = field(default_factory=dict)
    seeks: dict[PartitionKey, int] = field(default_factory=dict)


class BatchHandler(Protocol):
    name: str

    async def positions(
        self, cluster_id: str, partitions: list[PartitionKey]
    ) -> dict[PartitionKey, int]:
        """Where each partition resumes (stored with the effects)."""

    async def handle(
        self,
        cluster_id: str,
        batch: dict[PartitionKey, list[Any]],
        read_from: dict[PartitionKey, int] | None = None,
    ) -> HandleResult:
        """Apply a batch durably; raise a retriable StorageError to have it retried.
        ``read_from``: the consumer's position when it read each partition's records
        (where it is known), so the store can tell a hole in the log from a gap."""

    async def idle(self) -> None:
        """Periodic work (outbox sweeps, pruning): called when a poll returns nothing,
        and after a batch at least every ``periodic_every_s`` under steady load."""

    async def assigned(self, partitions: list[PartitionKey]) -> None:
        """Partitions this member did not hold before (their cache entries may have been
        left by a member that died): called before any of their records is handled."""


@dataclass(frozen=True)
class RuntimeConfig:
    bootstrap: str
    group_id: str
    topics: list[str]
    max_records: int = 500
    poll_timeout_ms: int = 200
    fetch_max_wait_ms: int = 100
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000
    commit_interval_s: float = 0.5
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    leave_timeout_s: float = 5.0
    commit_timeout_s: float = 5.0  # aiokafka's commit waits for a coordinator forever
    linger_ms: int = 0  # after a short poll, keep polling this long to fill the batch
    periodic_every_s: float = 1.0  # the handler's periodic work runs under load too
    # TLS/SASL options for every Kafka client (alma_core.messaging.kafka.client_options)
    client_options: dict[str, Any] = field(default_factory=dict)


def backoff_delay(attempt: int, initial: float, maximum: float, jitter: float = 0.2) -> float:
    """Exponential backoff with jitter: the pure decision the retry loop acts on."""
    base = min(maximum, initial * (2 ** max(0, attempt - 1)))
    return float(base * (1 + random.uniform(-jitter, jitter)))


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, runtime: ConsumerRuntime) -> None:
        self.runtime = runtime

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.runtime.metrics.rebalances.labels(self.runtime.handler.name).inc()
        if self.runtime.consumer is not None:
            with contextlib.suppress(KafkaError):
                await self.runtime.commit_pending(self.runtime.consumer)
        for tp in revoked:
            self.runtime.metrics.forget_partition(self.runtime.handler.name, tp.topic, tp.partition)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.runtime.on_assigned(assigned)


class ConsumerRuntime:
    def __init__(self, config: RuntimeConfig, handler: BatchHandler, metrics: Metrics) -> None:
        self.config = config
        self.handler = handler
        self.metrics = metrics
        self.consumer: AIOKafkaConsumer | None = None
        self.cluster_id = ""
        self.last_poll = 0.0
        self.assigned: set[TopicPartition] = set()
        self.started = asyncio.Event()
        self._admin: AIOKafkaAdminClient | None = None
        self._pending: dict[TopicPartition, int] = {}
        self._last_commit = 0.0
        self._last_periodic = 0.0
        self._applied_to: dict[TopicPartition, int] = {}  # next offset the store expects
        self._log_behind: set[TopicPartition] = set()
        # Where the consumer reads each partition from: the offset it was sent to, then
        # the offset after the last record it returned. Unknown after a fallback start.
        self._position: dict[TopicPartition, int] = {}

    async def _refresh_cluster_id(self) -> str:
        assert self._admin is not None
        cluster = await self._admin.describe_cluster()
        self.cluster_id = str(cluster["cluster_id"])
        return self.cluster_id

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        moved_here = set(assigned) - self.assigned
        self.assigned = set(assigned)
        if moved_here:
            await self.handler.assigned([(tp.topic, tp.partition) for tp in moved_here])
        self._applied_to.clear()
        self._log_behind.clear()
        self._position.clear()
        name = self.handler.name
        self.metrics.assigned_partitions.labels(name).set(len(assigned))
        if not assigned or self.consumer is None:
            return
        try:
            async with asyncio.timeout(10):
                cluster_id = await self._refresh_cluster_id()
                stored = await self.handler.positions(
                    cluster_id, [(tp.topic, tp.partition) for tp in assigned]
                )
        except (errors.StorageError, KafkaError, TimeoutError) as exc:
            # Kafka's committed offset is never ahead of the stored one, and the
            # store drops what it has already applied: a safe fallback.
            log.warning(
                "stored offsets unavailable, starting from Kafka's committed offsets",
                extra={"action": "assign_fallback", "consumer": name, "error": repr(exc)},
            )
            return
        for tp in assigned:
            offset = stored.get((tp.topic, tp.partition))
            if offset is not None:
                self.consumer.seek(tp, offset)
                self._applied_to[tp] = offset
                self._position[tp] = offset
        log.info(
            "partitions assigned",
            extra={"action": "assigned", "consumer": name, "partitions": len(assigned)},
        )

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        self._admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap, **cfg.client_options)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap,
            **cfg.client_options,
            group_id=cfg.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # records of aborted upstream transactions are not events
            isolation_level="read_committed",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            max_poll_interval_ms=cfg.max_poll_interval_ms,
            fetch_max_wait_ms=cfg.fetch_max_wait_ms,
            max_partition_fetch_bytes=16 * 1024 * 1024,
        )
        self.consumer = consumer
        if not await retry_start(self._admin.start, stop, "admin client"):
            return
        try:
            await self._refresh_cluster_id()
            consumer.subscribe(cfg.topics, listener=_Listener(self))
            if not await retry_start(consumer.start, stop, "consumer"):
                return
            self.last_poll = time.monotonic()
            self.started.set()
            await self._loop(consumer, stop)
            with contextlib.suppress(KafkaError):
                await self.commit_pending(consumer)
        finally:
            await self._leave(consumer)
            with contextlib.suppress(Exception):
                await self._admin.close()
            self.metrics.assigned_partitions.labels(self.handler.name).set(0)

    async def _leave(self, consumer: AIOKafkaConsumer) -> None:
        """Leave the group, but never wait on it for long: aiokafka's ``stop()`` first
        finishes a join in progress, which a broker may hold for the whole rebalance
        timeout. Past ``leave_timeout_s`` the member just goes; the broker evicts it
        after the session timeout, and nothing is lost (the offsets are stored with
        the effects)."""
        try:
            async with asyncio.timeout(self.config.leave_timeout_s):
                await consumer.stop()
        except TimeoutError:
            log.warning(
                "leaving the group took too long; the broker will evict this member after "
                "its session timeout",
                extra={
                    "action": "leave_timeout",
                    "consumer": self.handler.name,
                    "timeout_s": self.config.leave_timeout_s,
                },
            )
            # What stop() would have done after leaving: aiokafka has no public call for it.
            with contextlib.suppress(Exception):
                if consumer._fetcher is not None:
                    await consumer._fetcher.close()
                await consumer._client.close()
        except (Exception, asyncio.CancelledError) as exc:  # shutting down: report, never raise
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
                raise  # this task is being cancelled: not ours to swallow
            # anything else is reported, never raised; aiokafka's fetcher even re-raises the
            # cancellation of its own fetch task when closed while the broker is gone
            log.warning(
                "leaving the group failed",
                extra={"action": "leave_failed", "consumer": self.handler.name, "error": repr(exc)},
            )

    async def _loop(self, consumer: AIOKafkaConsumer, stop: asyncio.Event) -> None:
        name = self.handler.name
        while not stop.is_set():
            batch = await consumer.getmany(
                timeout_ms=self.config.poll_timeout_ms, max_records=self.config.max_records
            )
            if batch and self.config.linger_ms > 0:
                batch = await self._linger(consumer, batch)
            batch = self._check_log_ends(consumer, batch)
            self.last_poll = time.monotonic()
            self.metrics.last_poll.labels(name).set(time.time())
            if not batch:
                await self._periodic()
                if self._pending:  # a burst's last offsets: commit them while idle too
                    await self.commit_pending(consumer)
                continue
            plain = {(tp.topic, tp.partition): records for tp, records in batch.items()}
            read_from = {
                (tp.topic, tp.partition): self._position[tp] for tp in batch if tp in self._position
            }
            for tp, records in batch.items():
                self._position[tp] = records[-1].offset + 1
            result = await self._handle_with_retry(consumer, plain, read_from, stop)
            if result is None:
                return  # stopping during an outage: the batch is redelivered later
            await self._after(consumer, result)
            if time.monotonic() - self._last_periodic >= self.config.periodic_every_s:
                await self._periodic()

    async def _periodic(self) -> None:
        """The handler's periodic work; PostgreSQL being away postpones it (the next
        round tries again), like every other work, and never ends the consumer."""
        self._last_periodic = time.monotonic()
        try:
            await self.handler.idle()
        except errors.StorageError as exc:
            if not exc.retriable:
                raise
            self.metrics.storage_retries.labels(self.handler.name).inc()
            log.warning(
                "periodic work postponed: storage unavailable",
                extra={
                    "action": "periodic_postponed",
                    "consumer": self.handler.name,
                    "error": exc.message,
                },
            )

    def _check_log_ends(
        self, consumer: AIOKafkaConsumer, batch: dict[TopicPartition, list[Any]]
    ) -> dict[TopicPartition, list[Any]]:
        """Pause (and leave out of the batch) every partition whose log, as the broker's
        high watermark says, ends before what the store already applied. A paused
        partition fetches nothing, so it stays paused until the next assignment (a
        restart or a rebalance), which reads the stored offsets again."""
        name = self.handler.name
        for tp in consumer.assignment():
            applied, high = self._applied_to.get(tp), consumer.highwater(tp)
            if applied is None or high is None:
                continue
            if applied > high:
                batch.pop(tp, None)
                self.metrics.offsets_ahead_of_log.labels(name, tp.topic, str(tp.partition)).set(
                    applied - high
                )
                if tp not in self._log_behind:
                    self._log_behind.add(tp)
                    consumer.pause(tp)
                    log.error(
                        "the broker's log ends before what this group already applied; the "
                        "partition is paused, nothing is skipped. If the broker lost its log "
                        "and those records are gone, run `alma offsets reset` for it, then "
                        "restart the workers",
                        extra={
                            "action": "log_behind_stored_offset",
                            "consumer": name,
                            "topic": tp.topic,
                            "partition": tp.partition,
                            "applied_to": applied,
                            "high_watermark": high,
                            "cluster_id": self.cluster_id,
                        },
                    )
        return batch

    async def _linger(
        self, consumer: AIOKafkaConsumer, batch: dict[TopicPartition, list[Any]]
    ) -> dict[TopicPartition, list[Any]]:
        """Gather more records, up to ``max_records`` or ``linger_ms``: a handler whose
        cost is per call (one model call per batch) does more per call."""
        deadline = time.monotonic() + self.config.linger_ms / 1000
        while (n := sum(len(rs) for rs in batch.values())) < self.config.max_records:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            more = await consumer.getmany(
                timeout_ms=left_ms, max_records=self.config.max_records - n
            )
            for tp, records in more.items():
                batch.setdefault(tp, []).extend(records)
        return batch

    async def _handle_with_retry(
        self,
        consumer: AIOKafkaConsumer,
        batch: dict[PartitionKey, list[Any]],
        read_from: dict[PartitionKey, int],
        stop: asyncio.Event,
    ) -> HandleResult | None:
        name = self.handler.name
        attempt = 0
        paused = False
        try:
            while True:
                try:
                    return await self.handler.handle(self.cluster_id, batch, read_from)
                except errors.StorageError as exc:
                    if not exc.retriable:
                        raise
                    attempt += 1
                    self.metrics.storage_retries.labels(name).inc()
                    delay = backoff_delay(
                        attempt, self.config.backoff_initial_s, self.config.backoff_max_s
                    )
                    log.warning(
                        "storage unavailable; pausing and retrying the batch",
                        extra={
                            "action": "storage_retry",
                            "consumer": name,
                            "attempt": attempt,
                            "delay_s": round(delay, 2),
                            "error": exc.message,
                        },
                    )
                    if not paused:
                        consumer.pause(*consumer.assignment())
                        paused = True
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    if stop.is_set():
                        return None
                    await consumer.getmany(timeout_ms=0)  # keep the membership alive
                    self.last_poll = time.monotonic()
                    owned = {(tp.topic, tp.partition) for tp in consumer.assignment()}
                    batch = {tp: rs for tp, rs in batch.items() if tp in owned}
                    if not batch:
                        return HandleResult()
        finally:
            if paused:
                consumer.resume(*consumer.assignment())

    async def _after(self, consumer: AIOKafkaConsumer, result: HandleResult) -> None:
        name = self.handler.name
        owned = {(tp.topic, tp.partition): tp for tp in consumer.assignment()}
        for key, offset in result.seeks.items():
            if key in owned:
                consumer.seek(owned[key], offset)
                self._position[owned[key]] = offset
        for key, offset in result.next_offsets.items():
            if key in owned:
                tp = owned[key]
                self._applied_to[tp] = offset
                high = consumer.highwater(tp)
                if high is not None and offset > high:
                    continue  # the log ends before it: never commit that; the next poll reports
                self._pending[tp] = offset
                if high is not None:
                    self.metrics.lag.labels(name, tp.topic, str(tp.partition)).set(
                        max(0, high - offset)
                    )
        if time.monotonic() - self._last_commit >= self.config.commit_interval_s:
            await self.commit_pending(consumer)

    async def commit_pending(self, consumer: AIOKafkaConsumer) -> None:
        """Commit to Kafka what the store has already made durable. Only a hint for
        fallbacks (the stored offsets are the truth), so it is batched in time."""
        self._last_commit = time.monotonic()
        owned = consumer.assignment()
        commits = {tp: off for tp, off in self._pending.items() if tp in owned}
        self._pending.clear()
        if not commits:
            return
        name = self.handler.name
        started = time.perf_counter()
        try:
            # Never let the hint hold the loop: with the broker away, aiokafka's commit
            # waits for a coordinator without end (the batches after it would wait too,
            # and so would a shutdown); the next commit carries newer offsets anyway.
            async with asyncio.timeout(self.config.commit_timeout_s):
                await consumer.commit(commits)
        except (KafkaError, TimeoutError) as exc:
            self.metrics.commit_failures.labels(name).inc()
            log.warning(
                "Kafka offset commit failed",
                extra={"action": "commit_failed", "consumer": name, "error": repr(exc)},
            )
        self.metrics.commit_seconds.labels(name).observe(time.perf_counter() - started)


async def retry_start(start: Callable[[], Awaitable[Any]], stop: asyncio.Event, what: str) -> bool:
    """Start a Kafka client, retrying with backoff while the broker is unreachable.
    False when ``stop`` was set first (the caller leaves quietly)."""
    attempt = 0
    while not stop.is_set():
        try:
            await start()
            return True
        except KafkaError as exc:
            attempt += 1
            delay = backoff_delay(attempt, 0.5, 10.0)
            log.warning(
                "Kafka unreachable; retrying",
                extra={
                    "action": "kafka_retry",
                    "what": what,
                    "attempt": attempt,
                    "error": repr(exc),
                },
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
    return False
