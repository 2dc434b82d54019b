"""The Redis cache on a real Redis: compare-on-seq, epochs, completeness, outages."""

from __future__ import annotations

import uuid

from alma_core.storage.cache import CacheEntry, CacheWriter, RedisCheckpointCache
from tests.services import Services


def entry(run: str, field: str, seq: int) -> CacheEntry:
    return CacheEntry("t", run, field, seq, {"run_id": run, "tenant_id": "t", "seq": seq})


async def test_never_goes_back(services: Services) -> None:
    async with RedisCheckpointCache.connect(services.redis_url, prefix=uuid.uuid4().hex) as cache:
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


async def test_heads_only_when_complete_and_epoch_invalidates(services: Services) -> None:
    async with RedisCheckpointCache.connect(services.redis_url, prefix=uuid.uuid4().hex) as cache:
        await cache.put([entry("r", "@", 1)])
        assert await cache.heads("t", "r") is None  # a writer's partial view is not "all heads"
        await cache.put([entry("r", "@", 1), entry("r", "b:x", 2)], complete=True)
        heads = await cache.heads("t", "r")
        assert heads is not None
        assert set(heads) == {"@", "b:x"}
        await cache.bump_epoch()
        assert await cache.heads("t", "r") is None
        assert await cache.get("t", "r", "@") == (None, False)


async def test_writer_counts_failures_and_never_raises() -> None:
    async with RedisCheckpointCache.connect("redis://127.0.0.1:1/0", prefix="x") as cache:
        writer = CacheWriter(cache)
        assert await writer.write([entry("r", "latest", 1)]) is False
        assert await writer.write([entry("r", "latest", 2)]) is False  # skipped while down
        assert writer.failures == 2
        assert writer.degraded


async def test_a_failed_write_invalidates_as_soon_as_redis_answers(services: Services) -> None:
    """Redis refuses writes but still serves reads (out of memory): the entry a failed
    write should have replaced must stop being served once Redis takes writes again,
    without waiting for another write (the run's last event may have been that one)."""
    import redis.asyncio as aioredis

    from tests.integration.harness import wait_for

    admin = aioredis.Redis.from_url(services.redis_url)
    async with RedisCheckpointCache.connect(services.redis_url, prefix=uuid.uuid4().hex) as cache:
        writer = CacheWriter(cache, retry_after_s=0.2)
        await writer.open()
        try:
            assert await writer.write([entry("r", "latest", 1)])
            before = {
                **await admin.config_get("maxmemory"),
                **await admin.config_get("maxmemory-policy"),
            }
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", 1)  # every write refused, reads served
            try:
                assert await writer.write([entry("r", "latest", 2)]) is False
                doc, _ = await cache.get("t", "r", "latest")
                assert doc is not None
                assert doc["seq"] == 1  # what PostgreSQL has moved past
            finally:
                await admin.config_set("maxmemory", before["maxmemory"])
                await admin.config_set("maxmemory-policy", before["maxmemory-policy"])

            async def not_stale() -> bool:
                doc, _ = await cache.get("t", "r", "latest")
                return doc is None or doc["seq"] >= 2

            await wait_for(not_stale, what="the stale entry to stop being served", limit_s=10)
        finally:
            await writer.close()
            await admin.aclose()
