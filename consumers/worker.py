"""A worker process: the consumer groups it was asked for, wired to the services.

The HTTP endpoints come up first: liveness answers at once, readiness names
what start-up still waits for. Start-up waits for the services (retrying with
backoff, saying so in the log and in /readyz) rather than failing, and for a
schema older than the code (``alma db upgrade``, run by the migration Job during a
rolling upgrade); a schema that no longer admits this worker (newer migrations
that declare it too old) is an error that says what to deploy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from alma_core import errors, heap, tenancy, tracing
from alma_core.consumers import checkpointer, http, joiner, learner
from alma_core.consumers.handler import StoreHandler
from alma_core.consumers.metrics import Metrics, gc_pauses
from alma_core.consumers.outbox import OutboxRelay
from alma_core.consumers.retry import backoff_delay, retry_start, wait
from alma_core.consumers.runtime import ConsumerRuntime, RuntimeConfig
from alma_core.consumers.spans import BatchTracer
from alma_core.consumers.tenant_limits import LimitsReader
from alma_core.consumers.throttle import Throttle
from alma_core.learning import LearningPolicy
from alma_core.messaging import acls, kafka, topic_checks
from alma_core.messaging.topic_checks import TopicFacts
from alma_core.quotas import Quota, TenantGate
from alma_core.reducers import ReducerRegistry, default_registry
from alma_core.settings import Settings
from alma_core.storage import postgres
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.cache_writer import CacheWriter
from alma_core.storage.checkpoints import PostgresCheckpointStore, StoreConfig
from alma_core.storage.embeddings import AsyncEmbedder, load_embedder
from alma_core.storage.joins import JoinConfig, PostgresJoinStore
from alma_core.storage.memories import LearnConfig, PostgresLearnStore, check_dimension
from alma_core.storage.migrations import Migrator, compatibility, load_migrations
from alma_core.storage.read_marks import RedisReadMarks

log = logging.getLogger("alma.worker")

# The consumer groups a worker can run, by the name their metrics and logs carry; the
# short names of earlier releases are still accepted.
KNOWN_CONSUMERS = (checkpointer.NAME, joiner.NAME, learner.NAME)
CONSUMER_ALIASES = {"checkpoint": checkpointer.NAME, "join": joiner.NAME, "learn": learner.NAME}


@dataclass
class WorkerStatus:
    """What a running worker tells its caller: where its HTTP endpoints listen, its
    metrics (a process that also serves reads reports them there: the demo), and its
    consumers (what `alma up` reads of the broker's log through them)."""

    http_port: int = 0
    metrics: Metrics | None = None
    runtimes: list[ConsumerRuntime] = field(default_factory=list)


@dataclass(frozen=True)
class Services:
    kafka_bootstrap: str
    postgres_dsn: str
    redis_url: str


async def _pause(stop: asyncio.Event, attempt: int) -> None:
    await wait(stop, backoff_delay(attempt, 0.5, 10.0))


async def _wait_for_pool(
    dsn: str, settings: Settings, stop: asyncio.Event, health: http.Health
) -> asyncpg.Pool | None:
    attempt = 0
    health.waiting["postgres"] = "connecting"
    while not stop.is_set():
        try:
            pool = await postgres.create_pool(
                dsn,
                max_size=settings.pg_pool_size,
                lock_timeout_ms=settings.pg_lock_timeout_ms,
                idle_in_transaction_timeout_ms=settings.pg_idle_in_transaction_timeout_ms,
                generic_plans=settings.pg_generic_plans,
            )
        except errors.StorageError as exc:
            attempt += 1
            health.waiting["postgres"] = f"unreachable (attempt {attempt}): {exc.message}"
            log.warning(
                "PostgreSQL unreachable; retrying",
                extra={"action": "postgres_retry", "attempt": attempt, "error": exc.message},
            )
            await _pause(stop, attempt)
        else:
            del health.waiting["postgres"]
            return pool
    return None


async def wait_for_schema(pool: asyncpg.Pool, stop: asyncio.Event, health: http.Health) -> bool:
    """Wait until the schema has every migration this worker knows (False: stopped
    first); raise when the schema no longer admits this worker (only a deploy of a
    newer release helps, so restarting would not)."""
    built_for = len(load_migrations())
    attempt = 0
    while not stop.is_set():
        async with pool.acquire() as conn:
            migrator = Migrator(conn)
            current, oldest = await migrator.current(), await migrator.oldest_worker()
        problem = compatibility(built_for, current, oldest)
        if problem is None:
            health.waiting.pop("schema", None)
            return True
        if current >= built_for:
            raise errors.ConfigError(problem)
        attempt += 1
        health.waiting["schema"] = problem
        log.warning(problem, extra={"action": "schema_wait", "attempt": attempt})
        await _pause(stop, attempt)
    return False


@contextlib.asynccontextmanager
async def _producer(
    settings: Settings, bootstrap: str, stop: asyncio.Event
) -> AsyncIterator[AIOKafkaProducer | None]:
    """A started producer, or None when stopped before the broker answered."""

    def refused(exc: KafkaError) -> errors.BrokerDenied:
        # an idempotent producer's id is refused to a principal that may write no topic
        needs = acls.Acl("WRITE", "topic", settings.sequenced_topic)
        return acls.denied(acls.principal(settings), needs, exc)

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        **kafka.producer_options(settings),
        # no linger: the outbox sends a run's rows one after the other, each waiting for
        # its acknowledgement; the rows of other runs batch while one request is in
        # flight. Apache Kafka, 2 cores: a join's request -> reply (two outbox hops)
        # 41.2 -> 34.9 ms p50 (linger_ms=2 before; 4 alternating pairs)
        linger_ms=0,
        max_request_size=settings.max_record_bytes + 64 * 1024,
        max_batch_size=1024 * 1024,
    )
    started = await retry_start(producer.start, stop, "producer", refused)
    try:
        yield producer if started else None
    finally:
        await producer.stop()


async def _check_replay_window(settings: Settings, bootstrap: str) -> None:
    """Warn when a lifecycle topic (each tenant's, with ALMA_TENANT_TOPICS, as they are
    at start) keeps records longer than run rows live (a replay of such a record would
    start its pruned run again), and when it refuses records that ALMA would accept (its
    ``max.message.bytes`` under ALMA_MAX_RECORD_BYTES: the broker refuses them at the
    producer, so they never reach a dead letter); never stops the worker."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=5_000, **kafka.client_options(settings)
    )
    topics = [settings.lifecycle_topic]
    try:
        await admin.start()
        if settings.tenant_topics:
            pattern = settings.topic_names.lifecycle_pattern()
            topics = sorted(t for t in await admin.list_topics() if re.fullmatch(pattern, t))
            if not topics:
                return
        resources = [ConfigResource(ConfigResourceType.TOPIC, topic) for topic in topics]
        described = {
            r[3]: {e[0]: e[1] for e in r[4] if e[1] is not None}
            for response in await admin.describe_configs(resources)
            for r in response.resources
        }
    except (KafkaError, OSError, ValueError, IndexError) as exc:
        log.info(
            "the lifecycle topic's retention could not be read",
            extra={"action": "replay_window_unknown", "topic": topics[0], "error": repr(exc)},
        )
        return
    finally:
        await admin.close()
    for topic, configs in described.items():
        facts = TopicFacts(topic, 0, 0, configs)  # partitions and replicas not read here
        retention_ms = facts.config_int("retention.ms")
        problem = (
            None if retention_ms is None else settings.retention.replay_problem(topic, retention_ms)
        )
        if problem:
            log.warning(problem, extra={"action": "replay_window", "topic": topic})
        limit = topic_checks.record_limit_problem(facts, settings)
        if limit:
            largest = facts.config_int("max.message.bytes")
            log.warning(
                limit,
                extra={"action": "record_limit", "topic": topic, "max_message_bytes": largest},
            )


STOP_GRACE_S = 15.0  # how long the consumers get to leave their groups once stopped


async def _finish(tasks: list[asyncio.Task[None]], stop: asyncio.Event) -> None:
    """Wait for the consumers (the first error ends the worker, as before); once ``stop``
    is set, give them ``STOP_GRACE_S`` to leave, then cancel what still runs: a Kafka
    call that never returns (a join the broker never completes) must not keep the
    process from exiting, and nothing is lost (the offsets are stored with the effects)."""
    gathered: asyncio.Future[list[None]] = asyncio.gather(*tasks)
    stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([gathered, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            await asyncio.wait([gathered], timeout=STOP_GRACE_S)
        if gathered.done():
            await gathered
            return
        hung = [t.get_name() for t in tasks if not t.done()]
        log.warning(
            "consumers did not stop in time; cancelling them",
            extra={"action": "stop_timeout", "tasks": ",".join(hung), "grace_s": STOP_GRACE_S},
        )
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await gathered  # retrieved here; the outcomes below decide
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
    finally:
        stopping.cancel()


async def run_worker(
    settings: Settings,
    services: Services,
    consumers: list[str],
    stop: asyncio.Event,
    *,
    metrics: Metrics | None = None,
    ready: asyncio.Event | None = None,
    status: WorkerStatus | None = None,
    embedder: AsyncEmbedder | None = None,
) -> None:
    """Run the named consumer groups until ``stop`` is set. The learner loads the
    embedding model unless ``embedder`` is given (tests share one)."""
    consumers = [CONSUMER_ALIASES.get(c, c) for c in consumers]
    unknown = [c for c in consumers if c not in KNOWN_CONSUMERS]
    if unknown:
        raise errors.ConfigError(
            f"unknown consumer(s) {', '.join(unknown)}; known: {', '.join(KNOWN_CONSUMERS)}"
        )
    metrics = metrics or Metrics()
    if status is not None:
        status.metrics = metrics
    service = f"alma-{consumers[0]}" if len(consumers) == 1 else "alma-worker"
    traced = tracing.configure(
        service,
        exporter=settings.traces_exporter,
        protocol=settings.otel_exporter_otlp_protocol,
    )
    try:
        await _serve(settings, services, consumers, stop, metrics, ready, status, embedder)
    finally:
        if traced:
            tracing.shutdown()  # exports what is buffered


async def _serve(
    settings: Settings,
    services: Services,
    consumers: list[str],
    stop: asyncio.Event,
    metrics: Metrics,
    ready: asyncio.Event | None,
    status: WorkerStatus | None,
    embedder: AsyncEmbedder | None,
) -> None:
    health = http.Health()
    async with http.serve(
        settings.metrics_port, metrics.registry, health, settings.metrics_host
    ) as port:
        if status is not None:
            status.http_port = port
        with gc_pauses(metrics):
            await _run(
                settings, services, consumers, stop, metrics, health, ready, embedder, status
            )


async def freeze_when_ready(ready: asyncio.Event) -> None:
    """:func:`freeze_heap` once ``ready`` is set (the caller cancels it if the worker
    ends first)."""
    await ready.wait()
    heap.freeze_heap()


async def _run(
    settings: Settings,
    services: Services,
    consumers: list[str],
    stop: asyncio.Event,
    metrics: Metrics,
    health: http.Health,
    ready: asyncio.Event | None,
    embedder: AsyncEmbedder | None,
    status: WorkerStatus | None = None,
) -> None:
    own_embedder: AsyncEmbedder | None = None
    pool = await _wait_for_pool(services.postgres_dsn, settings, stop, health)
    if pool is None:
        return
    try:
        if not await wait_for_schema(pool, stop, health):
            return
        if learner.NAME in consumers:
            if embedder is None:
                health.waiting["model"] = "loading the embedding model"
                log.info("loading the embedding model", extra={"action": "embedder_load"})
                embedder = own_embedder = await asyncio.to_thread(load_embedder, settings)
            await check_dimension(pool, embedder.dimension, embedder.embedder.name)
            health.waiting.pop("model", None)
        health.waiting["kafka"] = f"connecting to {services.kafka_bootstrap}"
        async with (
            RedisCheckpointCache.for_settings(settings, services.redis_url) as cache,
            _producer(settings, services.kafka_bootstrap, stop) as producer,
        ):
            if producer is None:
                return
            del health.waiting["kafka"]
            if checkpointer.NAME in consumers:
                await _check_replay_window(settings, services.kafka_bootstrap)
            relay = OutboxRelay(
                pool,
                producer,
                metrics,
                kinds={
                    settings.sequenced_topic: "handoff",
                    settings.dlq_topic: "dlq",
                    settings.merged_topic: "reply",
                },
                reply_prefix=f"{settings.merged_topic}." if settings.tenant_topics else None,
            )
            await relay.sweep(force=True)
            cache_writer = CacheWriter(cache)  # invalidates the partitions it is assigned
            wiring = _Wiring(
                settings, services.kafka_bootstrap, pool, cache_writer, relay, metrics, cache
            )
            runtimes = wiring.runtimes(consumers, embedder)

            async def database_ok() -> bool:
                return bool(await pool.fetchval("SELECT 1"))

            async def broker_ok() -> bool:
                """A metadata request answered by some broker: a worker that lost the
                brokers polls on (nothing comes) and must not look ready for it."""
                consumer = next((r.consumer for r in runtimes if r.consumer is not None), None)
                if consumer is not None:  # else not started, which readiness says already
                    await consumer.topics()
                return True

            health.runtimes = runtimes
            if status is not None:
                status.runtimes = runtimes
            health.checks["postgres"] = database_ok
            health.checks["kafka"] = broker_ok
            if learner.NAME in consumers:
                health.embedder = embedder  # the model, for retrieval elsewhere
            log.info(
                "services up; consumers starting",
                extra={"action": "consumers_starting", "consumers": ",".join(consumers)},
            )
            tasks = [asyncio.create_task(r.run(stop), name=r.handler.name) for r in runtimes]
            started = asyncio.ensure_future(asyncio.gather(*(r.started.wait() for r in runtimes)))
            waiting: list[asyncio.Future[Any]] = [started, *tasks]
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if started in done and ready is not None:
                ready.set()
            try:
                await _finish(tasks, stop)
            finally:
                started.cancel()
                health.embedder = None
                await cache_writer.close()
    finally:
        health.checks.clear()
        if own_embedder is not None:
            own_embedder.close()
        await pool.close()


@dataclass(frozen=True)
class _Wiring:
    """What every consumer of a worker is built from: one pool, cache writer, outbox
    relay and metrics, and the settings that name their groups and topics."""

    settings: Settings
    bootstrap: str
    pool: asyncpg.Pool
    cache_writer: CacheWriter
    relay: OutboxRelay
    metrics: Metrics
    cache: RedisCheckpointCache

    def group(self, name: str) -> str:
        return f"{self.settings.group_prefix}-{name}"

    def runtimes(
        self, consumers: list[str], embedder: AsyncEmbedder | None
    ) -> list[ConsumerRuntime]:
        """The runtime of each consumer named, in the order checkpointer, joiner, learner."""
        registry = default_registry()
        built = []
        if checkpointer.NAME in consumers:
            built.append(self._checkpointer(registry))
        if joiner.NAME in consumers:
            built.append(self._joiner(registry))
        if learner.NAME in consumers:
            assert embedder is not None
            built.append(self._learner(embedder))
        return built

    def _runtime(
        self,
        name: str,
        topic: str,
        handler: StoreHandler[Any, Any],
        *,
        linger_ms: int = 0,
        max_records: int | None = None,
        pattern: str | None = None,
        throttle: Throttle | None = None,
    ) -> ConsumerRuntime:
        s = self.settings
        if tracing.active():
            marks = RedisReadMarks(self.cache, self.group(name))
            handler.tracer = BatchTracer(handler.name, self.group(name), marks)
        config = RuntimeConfig(
            bootstrap=self.bootstrap,
            group_id=self.group(name),
            topics=[topic],
            pattern=pattern,
            metadata_max_age_ms=tenancy.DISCOVERY_MS if pattern else 300_000,
            max_records=max_records or s.max_batch_records,
            linger_ms=linger_ms,
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            group_instance_id=s.group_instance_id,
            log_behind_grace_s=s.log_behind_grace_s,
            fetch_max_wait_ms=s.fetch_max_wait_ms,
            fetch_max_bytes=s.fetch_max_bytes,
            fetch_idle_wait_ms=s.fetch_idle_wait_ms,
            client_options=kafka.client_options(s),
            principal=acls.principal(s),
        )
        return ConsumerRuntime(config, handler, self.metrics, throttle)

    def _checkpointer(self, registry: ReducerRegistry) -> ConsumerRuntime:
        s = self.settings
        store = PostgresCheckpointStore(
            self.pool,
            StoreConfig(
                self.group(checkpointer.GROUP),
                checkpointer.NAME,
                s.sequenced_topic,
                s.dlq_topic,
                s.max_state_bytes,
                s.notify_effects,
                s.merged_topic,
                s.tenant_topics,
                s.tenant_storage_quota_bytes,
                s.unlocked_reads,
                s.run_memory_bytes,
            ),
            registry,
        )
        default = Quota(s.tenant_rate, s.tenant_burst)
        limits = LimitsReader(  # one read of the tenants' settings for the batch and quotas
            self.pool,
            self.metrics,
            max_state_bytes=s.max_state_bytes,
            storage_quota=s.tenant_storage_quota_bytes,
            storage=True,
            rate=default if s.tenant_topics else None,
        )
        handler = checkpointer.CheckpointHandler(
            store,
            self.cache_writer,
            self.relay,
            self.metrics,
            max_state_bytes=s.max_state_bytes,
            max_record_bytes=s.max_record_bytes,
            concurrency=s.checkpoint_transactions,
            topics=s.topic_names,
            limits=limits,
        )
        if not s.tenant_topics:
            return self._runtime(checkpointer.GROUP, s.lifecycle_topic, handler)
        throttle = Throttle(TenantGate(default), s.topic_names, self.metrics, limits)
        pattern = s.topic_names.lifecycle_pattern()
        return self._runtime(
            checkpointer.GROUP, s.lifecycle_topic, handler, pattern=pattern, throttle=throttle
        )

    def _joiner(self, registry: ReducerRegistry) -> ConsumerRuntime:
        s = self.settings
        store = PostgresJoinStore(
            self.pool,
            JoinConfig(
                self.group(joiner.GROUP),
                joiner.NAME,
                s.merged_topic,
                s.dlq_topic,
                s.max_state_bytes,
                s.tenant_topics,
            ),
            registry,
        )
        handler = joiner.JoinHandler(
            store,
            self.cache_writer,
            self.relay,
            self.metrics,
            # the sequenced topic carries join states as the checkpointer accepted them
            max_state_bytes=s.max_record_bytes,
            max_record_bytes=s.max_record_bytes,
        )
        return self._runtime(joiner.GROUP, s.sequenced_topic, handler)

    def _learner(self, embedder: AsyncEmbedder) -> ConsumerRuntime:
        s = self.settings
        store = PostgresLearnStore(
            self.pool,
            LearnConfig(
                self.group(learner.GROUP),
                learner.NAME,
                s.dlq_topic,
                LearningPolicy(min_occurrences=s.learn_min_occurrences),
                s.cleanup_checkpoints,
            ),
        )
        handler = learner.LearnHandler(
            store,
            self.cache_writer,
            self.relay,
            self.metrics,
            embedder,
            max_state_bytes=s.max_record_bytes,
            max_record_bytes=s.max_record_bytes,
            retention=s.retention,
            prune_every_s=s.prune_every_seconds,
        )
        return self._runtime(
            learner.GROUP,
            s.sequenced_topic,
            handler,
            linger_ms=s.embed_max_wait_ms,
            max_records=min(s.max_batch_records, 256),
        )
