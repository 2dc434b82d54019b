"""Faults inside other faults (docs/guarantees.md §7): a rebalance while the group retries a
batch that PostgreSQL refused for a while, a partition paused because its log was cut
while another one retries, an error of our own code inside the batch's transaction,
and the group's assignment placed while the main loop is busy. Each test drives real
members of a real group on the real broker, PostgreSQL and Redis, and counts what was
applied afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer, TopicPartition

from alma_core.cli.offsets import cluster_id
from alma_core.consumers.checkpointer import CheckpointHandler
from alma_core.consumers.metrics import Metrics
from alma_core.consumers.outbox import OutboxRelay
from alma_core.consumers.runtime import ConsumerRuntime, RuntimeConfig
from alma_core.reducers import default_registry
from alma_core.settings import Settings
from alma_core.storage import offsets, postgres
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.cache_writer import CacheWriter
from alma_core.storage.checkpoints import PostgresCheckpointStore, StoreConfig
from alma_core.storage.offsets import PartitionKey
from tests.integration.conftest import TEST_PARTITIONS
from tests.integration.harness import (
    Publisher,
    Worker,
    assert_exactly_once,
    completed,
    count,
    fetch,
    register_reducers,
    wait_for,
)


async def send_to(
    pub: Publisher, partition: int, doc: dict[str, Any], published: dict[str, list[Any]]
) -> None:
    """One event into one partition (its run's key, the partition chosen)."""
    published.setdefault(doc["run_id"], []).append(doc)
    await pub.producer.send(
        pub.topic, json.dumps(doc).encode(), key=doc["run_id"].encode(), partition=partition
    )


@contextlib.asynccontextmanager
async def offset_rows_locked(dsn: str, group: str, partitions: list[int]) -> AsyncIterator[None]:
    """Another session holds the row locks of these partitions' stored offsets (what a
    long transaction, a lock storm or a stalled member does): every batch of theirs waits
    for the lock timeout, then backs off and retries, until the block ends."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("BEGIN")
        await conn.execute(
            """SELECT 1 FROM consumer_offsets
               WHERE group_id = $1 AND partition = ANY($2::int[]) FOR UPDATE""",
            group,
            partitions,
        )
        yield
    finally:
        await conn.close()  # the transaction ends with the session: the locks go


def value(worker: Worker, name: str, **labels: str) -> float:
    return worker.value(name, {"consumer": "checkpointer", **labels})


async def test_a_rebalance_during_a_storage_retry_drops_nothing(settings: Settings) -> None:
    """The group's only member retries a batch (its partitions' offset rows are locked by
    another session, 55P03 each try) when a second member joins. The rebalance gives the
    first member a new assignment whose partitions aiokafka starts fetching at once; the
    retry's keep-alive polls must not consume those records, or the member's next batch
    starts above the stored offset and the missing range is taken for a hole in the log.
    Once the lock goes, every event is applied exactly once, in order, and no offset is
    counted as skipped."""
    settings = settings.model_copy(update={"pg_lock_timeout_ms": 300})
    dsn = settings.postgres_dsn or ""
    group = f"{settings.group_prefix}-checkpointer"
    published: dict[str, list[Any]] = {}
    partitions = list(range(TEST_PARTITIONS))
    async with (
        Worker.start(settings) as first,
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
    ):
        for p in partitions:  # every partition's offset row exists, so it can be locked
            await send_to(pub, p, completed(f"rb-{p}", updates={"step": 0}), published)
        await pub.flush()

        async def applied(n: int) -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == n

        await wait_for(lambda: applied(TEST_PARTITIONS), what="one checkpoint per partition")
        async with offset_rows_locked(dsn, group, partitions):
            for step in range(1, 11):
                for p in partitions:
                    doc = completed(f"rb-{p}", updates={"step": step})
                    await send_to(pub, p, doc, published)
            await pub.flush()

            async def retrying(at_least: float) -> bool:
                return value(first, "alma_storage_retries_total") >= at_least

            await wait_for(lambda: retrying(1), what="the first member to retry its batch")
            async with Worker.start(settings) as second:

                async def rebalanced() -> bool:
                    mine = value(first, "alma_assigned_partitions")
                    theirs = value(second, "alma_assigned_partitions")
                    return 0 < mine < TEST_PARTITIONS and theirs > 0

                await wait_for(rebalanced, what="the partitions shared by both members")
                # two more failed tries after the rebalance: keep-alive polls in between
                after = value(first, "alma_storage_retries_total")
                await wait_for(lambda: retrying(after + 2), what="retries after the rebalance")
                assert await count(dsn, "SELECT count(*) FROM checkpoints") == TEST_PARTITIONS
        total = sum(len(docs) for docs in published.values())
        await wait_for(lambda: applied(total), limit_s=60, what=f"all {total} checkpoints")
        assert value(first, "alma_offsets_skipped_total") == 0
    await assert_exactly_once(dsn, published)


async def test_a_partition_whose_log_was_cut_stays_paused_through_a_storage_retry(
    settings: Settings,
) -> None:
    """Partition 3's stored offset (50) lies beyond its log (the broker lost it): the
    member pauses it and says so. A storage retry on partition 0 (its offset row locked)
    must not resume it when the retry ends: its new records would be taken for the old
    log's, the ones below 50 never read, and the offset committed to Kafka past them, out
    of `alma offsets reset`'s reach. Once the offsets are reset, the new log is applied
    whole, exactly once."""
    settings = settings.model_copy(update={"pg_lock_timeout_ms": 300})
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    group = f"{settings.group_prefix}-checkpointer"
    topic, cut, other = settings.lifecycle_topic, 3, 0
    cluster = await cluster_id(bootstrap)
    conn = await asyncpg.connect(dsn)
    try:
        await offsets.set_offsets(conn, group, cluster, topic, {cut: 50})
    finally:
        await conn.close()
    published: dict[str, list[Any]] = {}
    new_log = [completed(f"cut-{i:02d}", state={"i": i}) for i in range(60)]
    async with (
        Worker.start(settings) as worker,
        Publisher(bootstrap, topic) as pub,
    ):
        await send_to(pub, other, completed("other", state={"n": 0}), published)
        await pub.flush()

        async def behind() -> bool:
            ahead = value(worker, "alma_offsets_ahead_of_log", topic=topic, partition=str(cut))
            return ahead > 0

        await wait_for(behind, what="partition 3 reported behind its stored offset")

        async def others(n: int) -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id = 'other'") == n

        await wait_for(lambda: others(1), what="partition 0's first event")
        async with offset_rows_locked(dsn, group, [other]):
            await send_to(pub, other, completed("other", state={"n": 1}), published)
            await pub.flush()
            await wait_for(
                lambda: _at_least(value(worker, "alma_storage_retries_total"), 1),
                what="a retry on partition 0",
            )
            for doc in new_log:
                await send_to(pub, cut, doc, {})
            await pub.flush()
        await wait_for(lambda: others(2), what="partition 0's retried batch")
        await send_to(pub, other, completed("other", state={"n": 2}), published)
        await pub.flush()
        await wait_for(lambda: others(3), what="partition 0 after the retry")
        # nothing of partition 3 was applied or committed: it is still paused
        assert await count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id LIKE 'cut-%'") == 0
        assert await behind()
    conn = await asyncpg.connect(dsn)
    try:  # what `alma offsets reset` does for the partition
        await offsets.forget(conn, group, cluster, topic, cut)
    finally:
        await conn.close()
    async with Worker.start(settings):

        async def new_log_applied() -> bool:
            n = await count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id LIKE 'cut-%'")
            return n == len(new_log)

        await wait_for(new_log_applied, limit_s=60, what="the new log of partition 3")
    await assert_exactly_once(dsn, published | {d["run_id"]: [d] for d in new_log})


async def _at_least(x: float, n: float) -> bool:
    return x >= n


async def test_an_os_error_from_our_own_code_inside_the_transaction_is_not_an_outage(
    settings: Settings,
) -> None:
    """A reducer (an application's, registered in the process) that raises
    ``ConnectionResetError`` while the batch's transaction is open: PostgreSQL is fine,
    so this is not an outage to wait out with every partition paused. The event is
    dead-lettered as ``internal_error`` and the partition goes on."""
    dsn = settings.postgres_dsn or ""

    def with_its_own_socket(current: Any, update: Any) -> Any:
        raise ConnectionResetError("the reducer's own connection was reset")

    registry = default_registry()
    registry.register("with_its_own_socket", with_its_own_socket)
    await register_reducers(dsn, "wf", {"total": "with_its_own_socket"})
    try:
        async with (
            Worker.start(settings) as worker,
            Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
        ):
            await pub.send(completed("r", state={"total": 1}))
            await pub.send(completed("r", updates={"total": 2}))
            await pub.send(completed("r", state={"total": 3}))
            await pub.flush()

            async def settled() -> bool:
                return await count(dsn, "SELECT count(*) FROM run_events") == 2

            await wait_for(settled, limit_s=30, what="the events around the failing one")
            letters = await fetch(dsn, "SELECT reason, detail FROM dead_letters")
            assert [r["reason"] for r in letters] == ["internal_error"]
            assert "ConnectionResetError" in letters[0]["detail"]
            assert value(worker, "alma_storage_retries_total") == 0
        rows = await fetch(dsn, "SELECT seq, state FROM checkpoints ORDER BY seq")
        assert [(r["seq"], r["state"]) for r in rows] == [(1, {"total": 1}), (2, {"total": 3})]
    finally:
        registry._reducers.pop("with_its_own_socket", None)


class RecordingHandler(CheckpointHandler):
    """The checkpointer's handler, noting which task reads the stored offsets and
    invalidates the cache of a new assignment."""

    tasks: set[str]
    runtime: ConsumerRuntime  # the member's, set by recording_member

    def _note(self) -> None:
        task = asyncio.current_task()
        self.tasks.add(task.get_name() if task is not None else "no task")

    async def positions(
        self, cluster_id: str, partitions: list[PartitionKey]
    ) -> dict[PartitionKey, int]:
        self._note()
        return await super().positions(cluster_id, partitions)

    async def assigned(self, partitions: list[PartitionKey]) -> None:
        self._note()
        await super().assigned(partitions)


@contextlib.asynccontextmanager
async def recording_member(
    settings: Settings, name: str, *, starved_after_s: float = 60.0
) -> AsyncIterator[RecordingHandler]:
    """A checkpointer member of the test's group, its main loop a task named ``name``."""
    bootstrap, dsn = settings.kafka_bootstrap or "", settings.postgres_dsn or ""
    metrics = Metrics()
    stop = asyncio.Event()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        async with (
            postgres.connect(dsn) as pool,
            RedisCheckpointCache.for_settings(settings) as cache,
        ):
            group = f"{settings.group_prefix}-checkpointer"
            store = PostgresCheckpointStore(
                pool,
                StoreConfig(
                    group, "checkpointer", settings.sequenced_topic, settings.dlq_topic, 65536
                ),
                default_registry(),
            )
            relay = OutboxRelay(pool, producer, metrics, kinds={})
            handler = RecordingHandler(
                store,
                CacheWriter(cache),
                relay,
                metrics,
                max_state_bytes=65536,
                max_record_bytes=1 << 20,
            )
            handler.tasks = set()
            runtime = ConsumerRuntime(
                RuntimeConfig(
                    bootstrap=bootstrap,
                    group_id=group,
                    topics=[settings.lifecycle_topic],
                    session_timeout_ms=settings.session_timeout_ms,
                    heartbeat_interval_ms=settings.heartbeat_interval_ms,
                    fetch_max_wait_ms=settings.fetch_max_wait_ms,
                    starved_after_s=starved_after_s,
                ),
                handler,
                metrics,
            )
            handler.runtime = runtime
            task = asyncio.create_task(runtime.run(stop), name=name)
            try:
                yield handler
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)
    finally:
        await producer.stop()


async def test_the_assignment_is_placed_by_the_main_loop_not_the_coordinator(
    settings: Settings,
) -> None:
    """aiokafka runs the rebalance listener in its coordinator task, while the main
    loop may be inside a batch. The stored offsets (PostgreSQL) and the cache
    invalidation (Redis) of a new assignment are the main loop's work, in order with
    its batches; the listener only pauses what it was given. Checked on a real group as
    it forms and rebalances, with events flowing."""
    dsn = settings.postgres_dsn or ""
    published: dict[str, list[Any]] = {}
    async with (
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
        recording_member(settings, "first-main") as first,
    ):
        for p in range(TEST_PARTITIONS):
            await send_to(pub, p, completed(f"pl-{p}", updates={"step": 0}), published)
        await pub.flush()
        await wait_for(lambda: _at_least(len(first.tasks), 1), what="the first assignment")
        async with recording_member(settings, "second-main") as second:
            for p in range(TEST_PARTITIONS):
                await send_to(pub, p, completed(f"pl-{p}", updates={"step": 1}), published)
            await pub.flush()

            async def both_placed() -> bool:
                return bool(second.tasks) and (
                    await count(dsn, "SELECT count(*) FROM checkpoints") == 2 * TEST_PARTITIONS
                )

            await wait_for(both_placed, what="the rebalance and both events of each partition")
    assert first.tasks == {"first-main"}
    assert second.tasks == {"second-main"}
    await assert_exactly_once(dsn, published)


async def test_a_partition_the_client_stops_fetching_is_fetched_by_a_new_consumer(
    settings: Settings,
) -> None:
    """The Kafka client can stop fetching a partition for good while the others flow
    (aiokafka, after a group coordinator's broker was cut off: tests/cluster). Injected
    here by pausing the client's partition behind ALMA's back: once it has brought no
    record for ``starved_after_s`` of polling while its leader says the log holds
    more, the member leaves the group and a new consumer joins, and every event is
    applied once."""
    dsn = settings.postgres_dsn or ""
    published: dict[str, list[Any]] = {}
    async with (
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
        recording_member(settings, "starving", starved_after_s=2.0) as member,
    ):
        for p in range(TEST_PARTITIONS):
            await send_to(pub, p, completed(f"st-{p}", updates={"step": 0}), published)
        await pub.flush()

        async def applied(n: int) -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == n

        await wait_for(lambda: applied(TEST_PARTITIONS), what="the first events")
        runtime = member.runtime
        stalled = runtime.consumer
        assert stalled is not None
        stalled.pause(TopicPartition(settings.lifecycle_topic, 0))  # the client's, not ALMA's
        for p in range(TEST_PARTITIONS):
            await send_to(pub, p, completed(f"st-{p}", updates={"step": 1}), published)
        await pub.flush()
        await wait_for(lambda: applied(2 * TEST_PARTITIONS), limit_s=60, what="every event")
        restarts = runtime.metrics.registry.get_sample_value(
            "alma_consumer_restarts_total", {"consumer": "checkpointer", "reason": "starved"}
        )
        assert restarts == 1
        assert runtime.consumer is not stalled
    await assert_exactly_once(dsn, published)
