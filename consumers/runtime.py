"""The consumer runtime shared by every consumer group: poll, hand a batch to the
handler, retry while storage is down, commit to Kafka after the handler's own
(database) commit, follow rebalances, drain and leave on shutdown.

What the runtime guarantees the handler:
* batches arrive in partition order, one at a time (no overlap);
* Kafka offsets are committed after the handler's commit, batched in time, and
  what is pending when a poll comes back empty is committed then (they are a hint
  for fallbacks and lag exporters; the handler's stored offsets are the truth);
* on assignment, each partition starts where the handler says it stopped
  (offsets stored with the effects; Kafka's committed offset where none is stored),
  placed by the main loop, never by aiokafka's rebalance listener: the listener runs
  in the coordinator's task while the main loop may be inside a batch, so it only
  pauses the partitions it was given and notes them; the loop invalidates their cache
  and seeks them before any of their records is fetched, retrying while storage is
  unavailable (they stay paused meanwhile);
* a retriable :class:`errors.StorageError` pauses consumption and retries the
  same batch with backoff until it succeeds or the worker stops; nothing is
  skipped, and the heartbeat and poll keep the membership alive meanwhile. Those
  keep-alive polls consume nothing (whatever they return is put back), and a
  rebalance during the retry drops the batch in hand: every partition of the new
  assignment starts again from its stored offset once placed;
* what is paused, and why, is decided in one place (:mod:`alma_core.consumers.assignment`):
  a partition paused for one reason is never resumed for another;
* a partition whose log ends before the offset the handler already applied is
  paused, never skipped silently: its records would otherwise look "already
  applied". A leader change looks like this for a moment (the new leader's high
  watermark trails the old one's until its followers fetch again), so its leader
  is asked again every ``log_recheck_every_s`` and the partition resumes once its
  log reaches the applied offset. Past ``log_behind_grace_s`` it is what it looks
  like, a broker that lost or replaced its log (a restart without its data, a new
  cluster with the same id): it stays paused and is reported
  (``alma_offsets_ahead_of_log``, an alert, and a log line that says to run
  ``alma offsets reset``);
* a consumer whose group gave it a new member id (its session lapsed: cut off or
  frozen) or that stopped fetching a partition whose log holds more
  (:mod:`alma_core.consumers.starvation`) is replaced by a new one: new connections
  to the brokers, every partition placed afresh from its stored offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupAuthorizationFailedError, KafkaError

from alma_core import errors
from alma_core.consumers.assignment import Assignment, Membership, key
from alma_core.consumers.metrics import Metrics
from alma_core.consumers.retry import FetchPacer, backoff_delay, retry_start, wait
from alma_core.consumers.starvation import StarvationWatch
from alma_core.consumers.throttle import Throttle
from alma_core.messaging import acls
from alma_core.storage.offsets import PartitionKey, Progress

log = logging.getLogger("alma.consumers")
PARTITION_FETCH_BYTES = 16 * 1024 * 1024  # the most of one partition in a fetch


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
    ) -> Progress:
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
    # instead of ``topics``: every topic whose name matches (ALMA_TENANT_TOPICS: each
    # tenant's lifecycle topic), new ones found within ``metadata_max_age_ms``
    pattern: str | None = None
    metadata_max_age_ms: int = 300_000
    max_records: int = 500
    poll_timeout_ms: int = 200
    fetch_max_wait_ms: int = 500  # Settings.fetch_max_wait_ms
    fetch_max_bytes: int = 50 * 1024 * 1024  # Settings.fetch_max_bytes
    fetch_idle_wait_ms: int = 0  # once no record came for 2 s (retry.FetchPacer); 0: off
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 1_000
    # Kafka's static membership (Settings.group_instance_id): a member that comes back
    # under the same name takes its partitions back without a rebalance
    group_instance_id: str | None = None
    max_poll_interval_ms: int = 300_000
    commit_interval_s: float = 0.5
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    leave_timeout_s: float = 5.0
    commit_timeout_s: float = 5.0  # aiokafka's commit waits for a coordinator forever
    log_behind_grace_s: float = 30.0  # Settings.log_behind_grace_s
    log_recheck_every_s: float = 0.5  # how often a partition behind asks its leader again
    # fetching time without a record of a partition whose log holds more, before the
    # consumer is started again (consumers/starvation.py)
    starved_after_s: float = 60.0
    linger_ms: int = 0  # after a short poll, keep polling this long to fill the batch
    periodic_every_s: float = 1.0  # the handler's periodic work runs under load too
    # TLS/SASL options for every Kafka client (alma_core.messaging.kafka.client_options)
    client_options: dict[str, Any] = field(default_factory=dict)
    principal: str = "this client"  # who the broker sees, as an ACL names it


class _Starved(Exception):
    """Partitions the client stopped fetching though their logs hold more."""

    def __init__(self, partitions: list[TopicPartition]) -> None:
        super().__init__(partitions)
        self.partitions = partitions


class _MembershipLost(Exception):
    """This member's group session lapsed and the client joined again under a new
    member id: it was cut off from the group's coordinator, and maybe from every
    broker, for a session or more."""


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Runs in aiokafka's coordinator task: notes and pauses, nothing more (the main
    loop places the partitions). Committing what is already durable before the
    partitions go is Kafka's own pattern, and only a hint."""

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
        consumer = self.runtime.consumer
        coordinator = getattr(consumer, "_coordinator", None)  # aiokafka's; no public name
        self.runtime.membership.joined(getattr(coordinator, "member_id", None))
        self.runtime.assignment.noted(consumer, set(assigned))
        self.runtime.reassigned.set()  # a long idle poll ends: place them now
        self.runtime.metrics.assigned_partitions.labels(self.runtime.handler.name).set(
            len(assigned)
        )


class ConsumerRuntime:
    def __init__(
        self,
        config: RuntimeConfig,
        handler: BatchHandler,
        metrics: Metrics,
        throttle: Throttle | None = None,
    ) -> None:
        self.config = config
        self.throttle = throttle  # tenants' rate quotas (consumers/throttle.py)
        self.handler = handler
        self.metrics = metrics
        self.consumer: AIOKafkaConsumer | None = None
        self.cluster_id = ""
        self.last_poll = 0.0
        self.started = asyncio.Event()
        self.reassigned = asyncio.Event()
        self.assignment = Assignment()
        self.membership = Membership()
        self._admin: AIOKafkaAdminClient | None = None
        self._pending: dict[TopicPartition, int] = {}
        self._last_commit = 0.0
        self._last_periodic = 0.0
        self._last_recheck = 0.0
        # partitions reported behind past the grace: when each fell behind (logged once)
        self._reported_behind: dict[TopicPartition, float] = {}
        self._watch = StarvationWatch(config.starved_after_s)
        self._poll_ms = config.poll_timeout_ms
        self._pacer = (
            FetchPacer(config.fetch_max_wait_ms, config.fetch_idle_wait_ms)
            if config.fetch_idle_wait_ms > config.fetch_max_wait_ms
            else None
        )

    def logs(self) -> dict[PartitionKey, tuple[int | None, int | None]]:
        """Each held partition's log end (the high watermark of its last fetch) and the
        offset the store expects next (None: not known)."""
        if self.consumer is None:
            return {}
        return {
            key(tp): (self.consumer.highwater(tp), self.assignment.applied_to.get(tp))
            for tp in self.consumer.assignment()
        }

    async def _refresh_cluster_id(self) -> str:
        assert self._admin is not None
        cluster = await self._admin.describe_cluster()
        self.cluster_id = str(cluster["cluster_id"])
        return self.cluster_id

    async def _place(self, consumer: AIOKafkaConsumer) -> bool:
        """Place a new assignment: invalidate the cache of the partitions that moved
        here, then seek each partition to where the handler says it stopped, and let
        them be fetched. False when storage (or the broker's admin API) did not answer:
        they stay paused and the loop tries again."""
        a = self.assignment
        generation, partitions = a.generation, sorted(a.unplaced)
        name = self.handler.name
        try:
            if moved := [key(tp) for tp in partitions if tp in a.moved_here]:
                await self.handler.assigned(moved)
            async with asyncio.timeout(10):
                cluster_id = await self._refresh_cluster_id()
                stored = await self.handler.positions(cluster_id, [key(tp) for tp in partitions])
        except (errors.StorageError, KafkaError, TimeoutError) as exc:
            if isinstance(exc, errors.StorageError) and not exc.retriable:
                raise
            self.metrics.storage_retries.labels(name).inc()
            log.warning(
                "stored offsets unavailable; the new partitions stay paused until they are read",
                extra={"action": "assign_postponed", "consumer": name, "error": repr(exc)},
            )
            return False
        if generation != a.generation:
            return False  # assigned again meanwhile: place that assignment instead
        a.placed(consumer, partitions, stored)
        log.info(
            "partitions assigned",
            extra={"action": "assigned", "consumer": name, "partitions": len(partitions)},
        )
        return True

    def _new_consumer(self) -> AIOKafkaConsumer:
        cfg = self.config
        return AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap,
            **cfg.client_options,
            group_id=cfg.group_id,
            group_instance_id=cfg.group_instance_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # records of aborted upstream transactions are not events
            isolation_level="read_committed",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            max_poll_interval_ms=cfg.max_poll_interval_ms,
            fetch_max_wait_ms=cfg.fetch_max_wait_ms,
            # a record larger than either still comes whole (Kafka's KIP-74; Tansu too)
            fetch_max_bytes=cfg.fetch_max_bytes,
            max_partition_fetch_bytes=min(PARTITION_FETCH_BYTES, cfg.fetch_max_bytes),
            metadata_max_age_ms=cfg.metadata_max_age_ms,
        )

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        self._admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap, **cfg.client_options)
        if not await retry_start(self._admin.start, stop, "admin client"):
            return
        try:
            await self._refresh_cluster_id()
            while not stop.is_set():
                if await self._member(stop):
                    return
        finally:
            with contextlib.suppress(Exception):
                await self._admin.close()
            self.metrics.assigned_partitions.labels(self.handler.name).set(0)

    async def _member(self, stop: asyncio.Event) -> bool:
        """One consumer in the group, from its start to its leave: True when the worker
        stops, False when a starved partition (:mod:`alma_core.consumers.starvation`)
        asks for a new consumer, which joins the group again and starts every
        partition afresh (what is applied is stored: nothing is lost or doubled)."""
        cfg = self.config
        consumer = self.consumer = self._new_consumer()
        try:
            if cfg.pattern is not None:
                consumer.subscribe(pattern=cfg.pattern, listener=_Listener(self))
            else:
                consumer.subscribe(cfg.topics, listener=_Listener(self))
            if not await retry_start(consumer.start, stop, "consumer", self._refused):
                return True
            if self.throttle is not None:  # the tenants' own quotas before any record
                await self.throttle.refresh()
            self.last_poll = time.monotonic()
            self.started.set()
            await self._loop(consumer, stop)
            with contextlib.suppress(KafkaError):
                await self.commit_pending(consumer)
            return True
        except _MembershipLost:
            self.metrics.consumer_restarts.labels(self.handler.name, "membership_lost").inc()
            log.warning(
                "this member's group session lapsed (it was cut off from the group's "
                "coordinator) and it joined again: this consumer leaves and a new one "
                "joins, with new connections to the brokers (one through a cut keeps "
                "its requests waiting for TCP's retransmission) and nothing remembered of "
                "its partitions (another member applied them meanwhile)",
                extra={"action": "consumer_membership_lost", "consumer": self.handler.name},
            )
            return False
        except _Starved as starved:
            self.metrics.consumer_restarts.labels(self.handler.name, "starved").inc()
            log.warning(
                "partitions not fetched for %g s of polling though their logs hold more: "
                "this consumer leaves the group and a new one joins",
                cfg.starved_after_s,
                extra={
                    "action": "consumer_starved",
                    "consumer": self.handler.name,
                    "partitions": [f"{tp.topic}[{tp.partition}]" for tp in starved.partitions],
                },
            )
            return False
        finally:
            await self._leave(consumer)
            # the next consumer's assignment is new in every way: each partition moved
            # here (its cache invalidated), nothing pending to commit; its generation
            # goes on counting (what keys on it, the throttle's held records, starts over)
            generation = self.assignment.generation
            self.assignment = Assignment()
            self.assignment.generation = generation
            self._pending.clear()
            self._watch = StarvationWatch(cfg.starved_after_s)
            self.membership = Membership()

    def _refused(self, exc: KafkaError) -> errors.BrokerDenied:
        """What a consumer of this group lacks when the authorizer refuses it."""
        cfg = self.config
        if isinstance(exc, GroupAuthorizationFailedError):
            needs = acls.Acl("READ", "group", cfg.group_id)
        else:
            topics = cfg.pattern or ", ".join(cfg.topics)
            needs = acls.Acl("READ", "topic", topics)
        return acls.denied(cfg.principal, needs, exc)

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
        placing = 0  # failed placements in a row
        a = self.assignment
        while not stop.is_set():
            if self.membership.lost:
                raise _MembershipLost()
            if a.unplaced:
                placing = 0 if await self._place(consumer) else placing + 1
                if placing:
                    await wait(stop, self._backoff(placing))  # then poll: stay a member
            if a.log_behind:
                await self._recheck_log_ends(consumer)
            if due := self._watch.due():
                await self._check_starved(consumer, due)
            generation = a.generation
            # a throttled tenant may go on after this long: the poll waits no longer
            cap_ms = (
                None
                if self.throttle is None
                else self.throttle.wait_ms(consumer, a, time.monotonic())
            )
            polling = time.monotonic()
            batch = await self._poll(consumer, stop, cap_ms)
            self._watch.polled(self._fetchable(consumer), batch, time.monotonic() - polling)
            self._pace(consumer, bool(batch))
            if batch and self.config.linger_ms > 0:
                batch = await self._linger(consumer, batch)
            self.last_poll = time.monotonic()
            self.metrics.last_poll.labels(name).set(time.time())
            if generation != a.generation:
                continue  # polled across a rebalance: read again once placed
            batch = self._check_log_ends(consumer, batch)
            if self.throttle is not None:  # records held back before come first
                batch = self.throttle.admit(consumer, a, batch, time.monotonic())
            if not batch:
                await self._periodic()
                if self._pending:  # a burst's last offsets: commit them while idle too
                    await self.commit_pending(consumer)
                continue
            plain = {key(tp): records for tp, records in batch.items()}
            read_from = a.read(batch)
            progress = await self._handle_with_retry(consumer, plain, read_from, stop)
            if progress is None:
                return  # stopping during an outage: the batch is redelivered later
            self._after(consumer, progress)
            if time.monotonic() - self._last_commit >= self.config.commit_interval_s:
                await self.commit_pending(consumer)
            if time.monotonic() - self._last_periodic >= self.config.periodic_every_s:
                await self._periodic()

    async def _poll(
        self, consumer: AIOKafkaConsumer, stop: asyncio.Event, cap_ms: int | None = None
    ) -> dict[Any, Any]:
        """The next records. Under load, or without the idle pace, a poll of
        ``poll_timeout_ms``. Idle, the poll lasts as long as the idle fetch wait: records
        end it at once (aiokafka returns what a fetch brings), and so do a stop and a new
        assignment; the loop no longer wakes five times a second for nothing."""
        limit = self.config.max_records
        poll_ms = self._poll_ms if cap_ms is None else min(self._poll_ms, cap_ms)
        if poll_ms <= self.config.poll_timeout_ms:
            batch: dict[Any, Any] = await consumer.getmany(timeout_ms=poll_ms, max_records=limit)
            return batch
        self.reassigned.clear()
        poll = asyncio.ensure_future(consumer.getmany(timeout_ms=poll_ms, max_records=limit))
        ends = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.reassigned.wait())]
        try:
            await asyncio.wait([poll, *ends], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in ends:
                task.cancel()
            if not poll.done():
                poll.cancel()  # waiting for a fetch: no record was taken
                await asyncio.wait([poll])
        records: dict[Any, Any] = {} if poll.cancelled() else poll.result()
        return records

    def _pace(self, consumer: AIOKafkaConsumer, got_records: bool) -> None:
        """Set the fetch wait the pacer chooses: aiokafka reads it from its fetcher for
        each fetch request it builds (no public setter; an aiokafka without the
        attribute keeps the wait it started with); and the next poll's length, the idle
        wait while the pacer has chosen it."""
        if self._pacer is None:
            return
        fetcher = getattr(consumer, "_fetcher", None)
        wanted = self._pacer.wait_ms(time.monotonic(), got_records)
        if fetcher is not None and getattr(fetcher, "_fetch_max_wait_ms", wanted) != wanted:
            fetcher._fetch_max_wait_ms = wanted
        self._poll_ms = max(self.config.poll_timeout_ms, wanted)

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(attempt, self.config.backoff_initial_s, self.config.backoff_max_s)

    async def _periodic(self) -> None:
        """The handler's periodic work; PostgreSQL being away postpones it (the next
        round tries again), like every other work, and never ends the consumer."""
        self._last_periodic = time.monotonic()
        if self.throttle is not None:
            await self.throttle.refresh()
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
        """Leave out and pause the partitions whose log ends before what the store
        already applied (:meth:`Assignment.behind`); report those still behind past
        the grace (a leader change has settled by then)."""
        name = self.handler.name
        now = time.monotonic()
        for tp, applied, high, new in self.assignment.behind(consumer, batch, now):
            if new:
                log.warning(
                    "the broker's log ends before what this group already applied: the "
                    "partition is paused while its leader is asked again (a leader change "
                    "looks like this for a moment)",
                    extra={
                        "action": "log_behind_waiting",
                        "consumer": name,
                        "topic": tp.topic,
                        "partition": tp.partition,
                        "applied_to": applied,
                        "high_watermark": high,
                    },
                )
            self._report_behind(tp, applied, high, now)
        return batch

    def _report_behind(self, tp: TopicPartition, applied: int, high: int, now: float) -> None:
        """Past the grace: the metric, and the error once."""
        first = self.assignment.log_behind.get(tp)
        if first is None or now - first < self.config.log_behind_grace_s:
            return
        name = self.handler.name
        if self._reported_behind.get(tp) != first:  # once for each time it fell behind
            self._reported_behind[tp] = first
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
        self.metrics.offsets_ahead_of_log.labels(name, tp.topic, str(tp.partition)).set(
            applied - high
        )

    def _fetchable(self, consumer: AIOKafkaConsumer) -> set[TopicPartition]:
        """The partitions the client should be fetching now: placed, and not held back
        here (behind their stored offset, throttled, a batch being retried)."""
        a = self.assignment
        if a.retrying:
            return set()
        return set(consumer.assignment()) - a.unplaced - a.log_behind.keys() - a.throttled

    async def _check_starved(self, consumer: AIOKafkaConsumer, due: list[TopicPartition]) -> None:
        """Ask the leaders of partitions that brought nothing for a while where their
        logs end; raise :class:`_Starved` for those with records past the position read
        (a leader that does not answer is an outage, not starvation: asked again later)."""
        try:
            ends = await asyncio.wait_for(consumer.end_offsets(due), 5.0)
        except (KafkaError, TimeoutError):
            return
        if starved := StarvationWatch.starved(due, self.assignment.position, ends):
            raise _Starved(starved)

    async def _recheck_log_ends(self, consumer: AIOKafkaConsumer) -> None:
        """Ask the leaders of the partitions behind, still within the grace, where their
        logs end now; resume those whose log reaches what was applied."""
        now = time.monotonic()
        a = self.assignment
        waiting = [
            tp for tp, first in a.log_behind.items() if now - first < self.config.log_behind_grace_s
        ]
        if not waiting or now - self._last_recheck < self.config.log_recheck_every_s:
            return
        self._last_recheck = now
        try:
            ends = await asyncio.wait_for(consumer.end_offsets(waiting), 5.0)
        except (KafkaError, TimeoutError) as exc:
            log.info(
                "where the logs end could not be asked: asked again shortly",
                extra={
                    "action": "log_recheck_failed",
                    "consumer": self.handler.name,
                    "error": repr(exc),
                },
            )
            return
        firsts = dict(a.log_behind)
        for tp in a.caught_up(consumer, ends):
            log.info(
                "the partition's log reaches what this group applied again (a leader "
                "change): resumed",
                extra={
                    "action": "log_caught_up",
                    "consumer": self.handler.name,
                    "topic": tp.topic,
                    "partition": tp.partition,
                    "waited_s": round(now - firsts[tp], 3),
                },
            )
        for tp in a.log_behind:
            applied, high = a.applied_to.get(tp), ends.get(tp)
            if applied is not None and high is not None:
                self._report_behind(tp, applied, high, now)

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
    ) -> Progress | None:
        """The batch handled, retried with backoff while storage is unavailable (nothing
        fetched meanwhile); None when stopped first. A rebalance during the retry drops
        the batch (no progress): the new assignment is placed at the stored offsets and
        its records read again, so nothing is skipped whoever owns them now."""
        name = self.handler.name
        a = self.assignment
        generation = a.generation
        attempt = 0
        try:
            while True:
                try:
                    return await self.handler.handle(self.cluster_id, batch, read_from)
                except errors.StorageError as exc:
                    if not exc.retriable:
                        raise
                    attempt += 1
                    self.metrics.storage_retries.labels(name).inc()
                    delay = self._backoff(attempt)
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
                    if not a.retrying:
                        a.retrying = True
                        a.sync_pauses(consumer)
                    if await wait(stop, delay):
                        return None
                    # poll for the group's liveness; all is paused: put back what comes
                    a.put_back(consumer, await consumer.getmany(timeout_ms=0))
                    self.last_poll = time.monotonic()
                    if generation != a.generation:
                        log.info(
                            "the assignment changed during the retry; the batch is read again "
                            "from the stored offsets",
                            extra={"action": "retry_rebalanced", "consumer": name},
                        )
                        return Progress()
        finally:
            if a.retrying:
                a.retrying = False
                a.sync_pauses(consumer)

    def _after(self, consumer: AIOKafkaConsumer, progress: Progress) -> None:
        """Follow a handled batch's progress: the offsets to commit, the lag."""
        name = self.handler.name
        for tp, (offset, high) in self.assignment.follow(consumer, progress).items():
            if high is not None and offset > high:
                continue  # the log ends before it: never commit that; the next poll reports
            self._pending[tp] = offset
            if high is not None:
                self.metrics.lag.labels(name, tp.topic, str(tp.partition)).set(
                    max(0, high - offset)
                )

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
