"""The Redis cache on a real Redis and on a real 3-node Redis Cluster: compare-on-seq,
epochs per partition, completeness, outages."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis

from alma_core.cli.embedded import RedisClusterStack
from alma_core.settings import Settings
from alma_core.storage.cache import RedisCheckpointCache, partition_of
from alma_core.storage.cache_entries import CacheEntry
from alma_core.storage.cache_writer import CacheWriter
from tests.integration.conftest import Topology
from tests.integration.harness import wait_for

PARTITIONS = 4


def entry(run: str, field: str, seq: int) -> CacheEntry:
    return CacheEntry("t", run, field, seq, {"run_id": run, "tenant_id": "t", "seq": seq})


def runs_by_partition(count: int) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for i in range(count):
        run = f"run-{i}"
        found.setdefault(partition_of(run, PARTITIONS), []).append(run)
    return found


@contextlib.asynccontextmanager
async def cache_on(topology: Topology) -> AsyncIterator[RedisCheckpointCache]:
    async with RedisCheckpointCache.connect(
        topology.url, prefix=uuid.uuid4().hex, cluster=topology.cluster, partitions=PARTITIONS
    ) as cache:
        yield cache


async def test_never_goes_back(topology: Topology) -> None:
    async with cache_on(topology) as cache:
        assert await cache.put([entry("r", "latest", 5)]) == 1
        assert await cache.put([entry("r", "latest", 3), entry("r", "latest", 5)]) == 0
        doc, complete = await cache.get("t", "r", "latest")
        assert doc is not None
        assert doc["seq"] == 5
        assert not complete
        assert await cache.put([entry("r", "latest", 6)]) == 1
        doc, _ = await cache.get("t", "r", "latest")
        assert doc is not None
        assert doc["seq"] == 6
        # one write spanning every partition: each partition's script on its own node
        runs = [f"r{i}" for i in range(40)]
        assert await cache.put([entry(r, "latest", 2) for r in runs]) == 40
        assert await cache.put([entry(r, "latest", 1) for r in runs]) == 0
        for r in runs:
            doc, _ = await cache.get("t", r, "latest")
            assert doc is not None
            assert doc["seq"] == 2


async def test_a_redis_that_forgot_the_script_is_written_all_the_same(
    topology: Topology,
) -> None:
    """A single Redis gets every partition's script in one pipeline; after a restart or
    SCRIPT FLUSH the server no longer knows it, and each call is made again, loading it."""
    async with cache_on(topology) as cache:
        runs = [f"f{i}" for i in range(20)]
        assert len({partition_of(r, PARTITIONS) for r in runs}) > 1
        assert await cache.put([entry(r, "latest", 1) for r in runs]) == 20
        await cache.client.script_flush()
        assert await cache.put([entry(r, "latest", 2) for r in runs]) == 20
        for r in runs:
            doc, _ = await cache.get("t", r, "latest")
            assert doc is not None
            assert doc["seq"] == 2


async def test_heads_only_when_complete_and_epoch_invalidates(topology: Topology) -> None:
    async with cache_on(topology) as cache:
        await cache.put([entry("r", "@", 1)])
        assert await cache.heads("t", "r") is None  # a writer's partial view is not "all heads"
        await cache.put([entry("r", "@", 1), entry("r", "b:x", 2)], complete=True)
        heads = await cache.heads("t", "r")
        assert heads is not None
        assert set(heads) == {"@", "b:x"}
        assert set(await cache.entries("t", "r")) == {"@", "b:x"}
        await cache.bump_epoch()
        assert await cache.heads("t", "r") is None
        assert await cache.get("t", "r", "@") == (None, False)
        assert await cache.entries("t", "r") == {}
        # a write under the new epoch starts the run's hash afresh
        assert await cache.put([entry("r", "@", 1)]) == 1
        assert set(await cache.entries("t", "r")) == {"@"}


async def test_a_partition_epoch_invalidates_that_partition_only(topology: Topology) -> None:
    """A rebalance moves some partitions: their entries become unreachable, the others
    stay (a rolling deploy no longer empties the whole cache)."""
    by_partition = runs_by_partition(40)
    assert set(by_partition) == set(range(PARTITIONS))
    async with cache_on(topology) as cache:
        everyone = [r for runs in by_partition.values() for r in runs]
        await cache.put([entry(r, "latest", 1) for r in everyone])
        writer = CacheWriter(cache)
        await writer.invalidate([1])
        for p, runs in by_partition.items():
            for r in runs:
                doc, _ = await cache.get("t", r, "latest")
                assert (doc is None) == (p == 1), (p, r)
        await writer.close()
        if topology.cluster:  # the partitions' slots are spread over the nodes
            keys = [f"{{{cache.prefix}:{p}}}:epoch" for p in range(PARTITIONS)]
            owners = {await _owner(topology, key) for key in keys}
            assert len(owners) >= 2, owners


async def _owner(topology: Topology, key: str) -> str:
    """The node that serves ``key``'s slot."""
    node = aioredis.Redis.from_url(topology.nodes[0])
    try:
        slot = await node.cluster("keyslot", key)
        ranges = await node.execute_command("CLUSTER", "SLOTS")
    finally:
        await node.aclose()
    for start, end, primary, *_ in ranges:
        if int(start) <= int(slot) <= int(end):
            return str(primary[1])
    raise AssertionError(f"no node serves {key}")


async def test_a_cluster_is_found_from_any_node_that_answers(
    redis_cluster: RedisClusterStack,
) -> None:
    """ALMA_REDIS_URL may list several nodes of a cluster: a first one that is down (or
    gone) does not matter while another answers."""
    urls = ",".join(["redis://127.0.0.1:1/0", *(n.url for n in redis_cluster.nodes[1:])])
    async with RedisCheckpointCache.connect(
        urls, prefix=uuid.uuid4().hex, cluster=True, partitions=PARTITIONS
    ) as cache:
        assert await cache.put([entry(f"r{i}", "latest", 1) for i in range(8)]) == 8
        doc, _ = await cache.get("t", "r3", "latest")
        assert doc is not None
        assert doc["seq"] == 1


async def test_writer_counts_failures_and_never_raises() -> None:
    async with RedisCheckpointCache.connect("redis://127.0.0.1:1/0", prefix="x") as cache:
        writer = CacheWriter(cache)
        assert await writer.write([entry("r", "latest", 1)]) is False
        assert await writer.write([entry("r", "latest", 2)]) is False  # skipped while down
        assert writer.failures == 2


async def test_a_failed_write_invalidates_as_soon_as_redis_answers(topology: Topology) -> None:
    """Redis refuses writes but still serves reads (out of memory): the entry a failed
    write should have replaced must stop being served once Redis takes writes again,
    without waiting for another write (the run's last event may have been that one)."""
    admins = [aioredis.Redis.from_url(url) for url in topology.nodes]
    async with cache_on(topology) as cache:
        writer = CacheWriter(cache, retry_after_s=0.2)
        try:
            assert await writer.write([entry("r", "latest", 1)])
            before = []
            for admin in admins:
                before.append(
                    {
                        **await admin.config_get("maxmemory"),
                        **await admin.config_get("maxmemory-policy"),
                    }
                )
                await admin.config_set("maxmemory-policy", "noeviction")
                await admin.config_set("maxmemory", 1)  # every write refused, reads served
            try:
                assert await writer.write([entry("r", "latest", 2)]) is False
                doc, _ = await cache.get("t", "r", "latest")
                assert doc is not None
                assert doc["seq"] == 1  # what PostgreSQL has moved past
            finally:
                for admin, old in zip(admins, before, strict=True):
                    await admin.config_set("maxmemory", old["maxmemory"])
                    await admin.config_set("maxmemory-policy", old["maxmemory-policy"])

            async def not_stale() -> bool:
                doc, _ = await cache.get("t", "r", "latest")
                return doc is None or doc["seq"] >= 2

            await wait_for(not_stale, what="the stale entry to stop being served", limit_s=10)
        finally:
            await writer.close()
            for admin in admins:
                await admin.aclose()


async def test_a_rebalance_invalidates_only_the_partitions_that_moved(settings: Settings) -> None:
    """A member bumps the epochs of the partitions newly assigned to it, not of every
    partition: a second member joining (a rolling deploy, a scale-out) invalidates the
    partitions it takes over, and the entries of the others stay."""
    from tests.integration.harness import Worker

    async with RedisCheckpointCache.for_settings(settings) as cache:
        keys = [f"{{{cache.prefix}:{p}}}:epoch" for p in range(settings.partitions)]

        async def epochs() -> list[int]:
            return [int(v or 0) for v in await cache.client.mget(keys)]

        async with Worker.start(settings):
            first = await wait_for(
                lambda: _all_bumped(epochs), what="the first member's partitions invalidated"
            )
            assert first == [1] * settings.partitions
            async with Worker.start(settings):

                async def moved() -> list[int] | None:
                    now = await epochs()
                    return now if now != first else None

                after = await wait_for(moved, what="the second member's partitions")
                await asyncio.sleep(1.0)  # the group settles: nothing else moves
                assert await epochs() == after
    assert sorted(after) == [1, 1, 2, 2], "the 2 partitions that moved, and only them"


async def _all_bumped(epochs: Callable[[], Awaitable[list[int]]]) -> list[int] | None:
    found = await epochs()
    return found if all(found) else None
