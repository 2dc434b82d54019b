"""The Redis cache on a real Redis: compare-on-seq, epochs, completeness, outages."""

from __future__ import annotations

import uuid

from alma_core.storage.cache import CacheEntry, CacheWriter, RedisCheckpointCache
from tests.services import Services


def entry(run: str, field: str, seq: int) -> CacheEntry:
    return CacheEntry(run, field, seq, {"run_id": run, "tenant_id": "t", "seq": seq})


async def test_never_goes_back(services: Services) -> None:
    async with RedisCheckpointCache.connect(services.redis_url, prefix=uuid.uuid4().hex) as cache:
        assert await cache.put([entry("r", "latest", 5)]) == 1
        assert await cache.put([entry("r", "latest", 3), entry("r", "latest", 5)]) == 0
        doc, complete = await cache.get("r", "latest")
        assert doc is not None
        assert doc["seq"] == 5
        assert not complete
        assert await cache.put([entry("r", "latest", 6)]) == 1
        doc, _ = await cache.get("r", "latest")
        assert doc is not None
        assert doc["seq"] == 6


async def test_heads_only_when_complete_and_epoch_invalidates(services: Services) -> None:
    async with RedisCheckpointCache.connect(services.redis_url, prefix=uuid.uuid4().hex) as cache:
        await cache.put([entry("r", "@", 1)])
        assert await cache.heads("r") is None  # a writer's partial view is not "all heads"
        await cache.put([entry("r", "@", 1), entry("r", "b:x", 2)], complete=True)
        heads = await cache.heads("r")
        assert heads is not None
        assert set(heads) == {"@", "b:x"}
        await cache.bump_epoch()
        assert await cache.heads("r") is None
        assert await cache.get("r", "@") == (None, False)


async def test_writer_counts_failures_and_never_raises() -> None:
    async with RedisCheckpointCache.connect("redis://127.0.0.1:1/0", prefix="x") as cache:
        writer = CacheWriter(cache)
        assert await writer.write([entry("r", "latest", 1)]) is False
        assert await writer.write([entry("r", "latest", 2)]) is False  # skipped while down
        assert writer.failures == 2
        assert writer.degraded
