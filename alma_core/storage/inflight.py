"""Writes in flight: events a ``wait="published"`` writer published and has not seen
applied yet, marked per run in Redis so that a reader in any other process waits for
them instead of answering from a state they are about to change (docs/langgraph.md).

A writer marks an event once the broker has it (so no mark names an event that was never
published) and clears it once it saw it applied or refused; a reader clears the marks it
found settled. A mark that is never cleared (its writer died, or the broker lost the
record) expires with its run's set, ``TTL_S`` after the run's newest mark. Redis
failures are not raised: ``mark`` answers False (the writer then waits as ``applied``
does) and ``marked`` None (the reader cannot know; see the docs).
"""

from __future__ import annotations

import time

from alma_core.storage.cache import (
    CLIENT_FAILURES,
    RedisCheckpointCache,
    partition_key,
    run_key,
)

TTL_S = 3600


class InFlight:
    """The marks of writes in flight, in the cache's Redis (its prefix, its slots)."""

    def __init__(self, cache: RedisCheckpointCache) -> None:
        self.cache = cache

    def _key(self, tenant_id: str, run_id: str) -> str:
        p = self.cache.partition(run_id)
        return partition_key(self.cache.prefix, p, f"inflight:{run_key(tenant_id, run_id)}")

    async def mark(self, tenant_id: str, run_id: str, event_id: str) -> bool:
        """Mark a published event of the run (one round trip); False when Redis did
        not take it."""
        key = self._key(tenant_id, run_id)
        try:
            await self.cache.ready()
            async with self.cache.client.pipeline(transaction=False) as pipe:
                pipe.zadd(key, {event_id: time.time()})
                pipe.expire(key, TTL_S)
                await pipe.execute()
        except CLIENT_FAILURES:
            return False
        return True

    async def clear(self, tenant_id: str, run_id: str, event_ids: list[str]) -> None:
        """Forget these marks (applied or refused); a failure leaves them to expire."""
        if event_ids:
            try:
                await self.cache.ready()
                await self.cache.client.zrem(self._key(tenant_id, run_id), *event_ids)
            except CLIENT_FAILURES:
                return

    async def marked(self, tenant_id: str, run_id: str) -> list[str] | None:
        """The run's marked events, oldest first; None when Redis cannot say."""
        try:
            await self.cache.ready()
            found = await self.cache.client.zrange(self._key(tenant_id, run_id), 0, -1)
        except CLIENT_FAILURES:
            return None
        return [e.decode() if isinstance(e, bytes) else str(e) for e in found]
