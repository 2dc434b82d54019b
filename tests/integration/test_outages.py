"""Outages pause, never drop (docs/guarantees.md §7): PostgreSQL and Redis restarted mid-stream."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from alma_core.cli.embedded import Redis, RedisClusterStack
from alma_core.settings import Settings
from alma_core.storage import postgres
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.embeddings import AsyncEmbedder
from tests.integration.conftest import PrivateStack
from tests.integration.harness import (
    Publisher,
    Worker,
    assert_cache_matches,
    assert_exactly_once,
    assert_reads_fresh,
    completed,
    count,
    wait_for,
)

RUNS = [f"run-{i}" for i in range(5)]


async def publish_steps(
    pub: Publisher, published: dict[str, list[dict[str, Any]]], steps: range
) -> None:
    for step in steps:
        for run in RUNS:
            doc = completed(run, updates={"step": step})
            published.setdefault(run, []).append(doc)
            await pub.send(doc)
    await pub.flush()


async def test_postgres_restart_mid_stream_loses_and_doubles_nothing(
    private_stack: PrivateStack,
) -> None:
    settings = private_stack.settings
    dsn = settings.postgres_dsn
    assert dsn
    pg = private_stack.postgres
    published: dict[str, list[dict[str, Any]]] = {}
    async with (
        Worker.start(settings) as worker,
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
    ):
        await publish_steps(pub, published, range(0, 10))

        async def first_part() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") >= 20

        await wait_for(first_part, what="first checkpoints")
        port = pg.port
        pg.kill()  # a crash, not a clean shutdown
        await publish_steps(pub, published, range(10, 30))
        await wait_for(
            lambda: _async(
                worker.value("alma_storage_retries_total", {"consumer": "checkpointer"})
            ),
            what="the worker to notice the outage",
        )
        await pg.start(port=port)
        await publish_steps(pub, published, range(30, 40))

        async def all_in() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 5 * 40

        await wait_for(all_in, limit_s=90, what="all 200 checkpoints")
    await assert_exactly_once(dsn, published)


async def test_redis_outage_never_stalls_and_the_cache_never_goes_back(
    private_stack: PrivateStack,
) -> None:
    """Redis goes away mid-stream and comes back from an older snapshot (what a restart
    from its last RDB file does): the pipeline never stalls, readers never see the
    snapshot's older checkpoints, and the cache is current again."""
    await redis_outage(private_stack.settings, private_stack.redis)


async def test_a_cluster_node_outage_never_stalls_and_the_cache_never_goes_back(
    settings: Settings, redis_cluster: RedisClusterStack
) -> None:
    """The same on a 3-node Redis Cluster: the node serving the runs' partitions goes
    away and comes back from an older snapshot."""
    on_cluster = settings.model_copy(update={"redis_url": redis_cluster.url, "redis_cluster": True})
    async with RedisCheckpointCache.for_settings(on_cluster) as cache:
        slots = {cache.partition(run) for run in RUNS}
        owners = {p: await _owner_of(redis_cluster, f"{{{cache.prefix}:{p}}}:epoch") for p in slots}
    # not the node the URL names (new clients find the cluster through it)
    candidates = [n for n in redis_cluster.nodes[1:] if n.port in owners.values()]
    assert candidates, f"the runs' partitions {owners} all live on the seed node"
    node = max(candidates, key=lambda n: list(owners.values()).count(n.port))
    await redis_outage(on_cluster, node)


async def _owner_of(cluster: RedisClusterStack, key: str) -> int:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(cluster.url)
    try:
        slot = int(await client.cluster("keyslot", key))
        for start, end, primary, *_ in await client.execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                return int(primary[1])
    finally:
        await client.aclose()
    raise AssertionError(f"no node serves {key}")


async def redis_outage(settings: Settings, redis: Redis) -> None:
    """Stop ``redis`` (one Redis, or one node of a cluster) mid-stream after a snapshot
    and start it again from it."""
    import redis.asyncio as aioredis

    dsn = settings.postgres_dsn
    assert dsn
    published: dict[str, list[dict[str, Any]]] = {}
    async with (
        Worker.start(settings) as worker,
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
    ):
        await publish_steps(pub, published, range(0, 5))

        async def n_in(n: int) -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == n

        await wait_for(lambda: n_in(25), what="25 checkpoints")
        await wait_for(lambda: cached(settings, 5), what="every run cached at seq 5")
        admin = aioredis.Redis.from_url(redis.url)
        try:
            await admin.save()  # the snapshot Redis will come back from
        finally:
            await admin.aclose()
        await publish_steps(pub, published, range(5, 10))
        await wait_for(lambda: n_in(50), what="50 checkpoints, cached after the snapshot")
        port = redis.port
        await redis.stop()
        await publish_steps(pub, published, range(10, 15))
        # The pipeline goes on without the cache.
        await wait_for(lambda: n_in(75), what="75 checkpoints while Redis is down")
        # the failed cache write comes after its batch's commit (on a cluster, after the
        # client's own retries): wait for it rather than race it
        await wait_for(
            lambda: _async(worker.value("alma_cache_operations_total", {"result": "write_error"})),
            limit_s=30,
            what="a cache write counted as failed while Redis is down",
        )
        await redis.start(port=port)  # from the snapshot: every run 10 steps behind
        await assert_reads_fresh(settings, RUNS)  # at once, before anything is written
        # Every read is PostgreSQL's latest, whatever Redis holds, while the writers come
        # back: they skip Redis for about a second after a failure, then invalidate what
        # was there and cache again (keep the events coming for a while).
        writes = worker.value("alma_cache_operations_total", {"result": "write"})
        cached_again = False
        for step in range(15, 35):
            await publish_steps(pub, published, range(step, step + 1))
            await wait_for(lambda n=5 * (step + 1): n_in(n), what="checkpoints after Redis")
            await assert_reads_fresh(settings, RUNS)
            now = worker.value("alma_cache_operations_total", {"result": "write"})
            if cached_again:
                break  # one more round after the writers came back: their writes settle
            cached_again = now > writes
            await asyncio.sleep(0.3)
        assert cached_again, "the writers never cached again after Redis came back"
    await assert_exactly_once(dsn, published)
    assert await assert_cache_matches(settings, RUNS, require_all=True) == len(RUNS)


async def cached(settings: Settings, seq: int) -> bool:
    """Every run's latest checkpoint is in Redis at ``seq`` (read raw: a read through the
    reader would fill it)."""
    async with RedisCheckpointCache.for_settings(settings) as cache:
        for run in RUNS:
            latest, _ = await cache.get("acme", run, "latest")
            if latest is None or latest["seq"] != seq:
                return False
    return True


async def _async(value: float) -> float:
    await asyncio.sleep(0)
    return value


async def test_the_learner_pauses_through_an_outage_with_retention_on(
    private_stack: PrivateStack, embedder: AsyncEmbedder
) -> None:
    """Retention prunes in the learner's idle time; PostgreSQL going away while it does
    must pause the learner like any other work, never end it."""
    settings = private_stack.settings.model_copy(
        update={"checkpoint_retention_days": 30, "prune_every_seconds": 0.2}
    )
    dsn = settings.postgres_dsn or ""
    pg = private_stack.postgres
    async with (
        Worker.start(settings, ("checkpointer", "learner"), embedder) as worker,
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
    ):
        port = pg.port
        pg.kill()
        await asyncio.sleep(2)  # several idle rounds, each pruning, all failing
        assert worker.task is not None
        assert not worker.task.done(), "the worker ended during the outage"
        await pg.start(port=port)
        await pub.send(completed("after", state={"n": 1}))
        await pub.send(
            {
                **completed("after", node=None),
                "type": "workflow.completed",
                "payload": {
                    "outcome": "success",
                    "duration_ms": 5,
                    "node_count": 1,
                    "nodes_succeeded": 1,
                    "nodes_failed": 0,
                },
            }
        )
        await pub.flush()

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 1

        await wait_for(learned, limit_s=90, what="the outcome after the outage")


async def test_a_zombie_transaction_holding_a_partition_is_cut_off(settings: Settings) -> None:
    """A member that stalled inside its batch's transaction (its event loop blocked, its
    network cut) holds the lock on its partitions' offsets. The new owner waits at most
    ALMA_PG_LOCK_TIMEOUT_MS per try (then backs off and retries), and PostgreSQL ends
    the zombie's session after ALMA_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS: the partition
    goes on instead of waiting for hours."""
    settings = settings.model_copy(
        update={"pg_lock_timeout_ms": 300, "pg_idle_in_transaction_timeout_ms": 2000}
    )
    dsn = settings.postgres_dsn or ""
    group = f"{settings.group_prefix}-checkpointer"
    async with (
        Worker.start(settings) as worker,
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
    ):
        await pub.send(completed("zombie", state={"n": 0}))
        await pub.flush()

        async def first() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 1

        await wait_for(first, what="the first checkpoint")
        zombie = await postgres.create_pool(
            dsn,
            max_size=1,
            lock_timeout_ms=settings.pg_lock_timeout_ms,
            idle_in_transaction_timeout_ms=settings.pg_idle_in_transaction_timeout_ms,
        )
        try:
            conn = await zombie.acquire()
            await conn.execute("BEGIN")
            await conn.execute(  # what a stalled member's batch holds
                "SELECT 1 FROM consumer_offsets WHERE group_id = $1 FOR UPDATE", group
            )
            await pub.send(completed("zombie", state={"n": 1}))
            await pub.flush()

            async def second() -> bool:
                return await count(dsn, "SELECT count(*) FROM checkpoints") == 2

            await wait_for(second, limit_s=30, what="the partition to go on")
            retried = worker.value("alma_storage_retries_total", {"consumer": "checkpointer"})
            assert retried >= 1  # it waited on the lock, gave up, backed off
            # the server ended the zombie's session (the pool let go of it)
            with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError)):
                await conn.execute("SELECT 1")
        finally:
            await zombie.expire_connections()
            zombie.terminate()
