"""The writers' side of the checkpoint cache (:class:`CacheWriter`): count failures,
skip Redis while it is down, and invalidate what may be stale as soon as it answers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable

from alma_core import errors
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.cache_entries import CacheEntry


class CacheWriter:
    """The writers' side: count failures, skip Redis while it is down, and invalidate
    the partitions whose entries may be stale (those newly assigned to this member,
    those of writes that failed) as soon as Redis answers."""

    def __init__(
        self,
        cache: RedisCheckpointCache,
        *,
        retry_after_s: float = 1.0,
        repair_max_s: float = 10.0,
    ) -> None:
        self.cache = cache
        self.retry_after_s = retry_after_s
        self.repair_max_s = repair_max_s
        self._stale: set[int] = set()  # partitions to invalidate before the next write
        self._skip_until = 0.0
        self._repair: asyncio.Task[None] | None = None
        self.failures = 0

    async def invalidate(self, partitions: Iterable[int]) -> None:
        """Partitions newly assigned to this member: a member that died may have left
        entries of them that its writes would not replace. Now, or once Redis answers."""
        self._stale.update(partitions)
        if self._stale:
            await self._attempt(_nothing, ())

    async def close(self) -> None:
        """Stop the repair task (the next owner of the partitions invalidates them)."""
        if self._repair is not None:
            self._repair.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._repair
            self._repair = None

    def _schedule_repair(self) -> None:
        """After a failed write Redis may still serve the entry that write should have
        replaced: invalidate as soon as Redis answers, not at this writer's next write
        (there may be none: the run's last event)."""
        if self._repair is None or self._repair.done():
            self._repair = asyncio.create_task(self._repair_loop())

    async def _repair_loop(self) -> None:
        delay = self.retry_after_s
        while self._stale:
            await asyncio.sleep(delay)
            try:
                await self._bump_stale()
            except errors.CacheError:
                delay = min(delay * 2, self.repair_max_s)

    async def _bump_stale(self) -> None:
        stale = set(self._stale)
        await self.cache.bump_epoch(stale)
        self._stale -= stale

    async def forget(self, runs: list[tuple[str, str]]) -> bool:
        """Drop runs whose checkpoints were deleted; when Redis is down, their
        partitions are invalidated on its return all the same."""
        parts = {self.cache.partition(r) for _, r in runs}
        return await self._attempt(lambda: self.cache.delete(runs), parts)

    async def write(self, entries: list[CacheEntry]) -> bool:
        """True when written; False when Redis is down (counted, never raised)."""
        parts = {self.cache.partition(e.run_id) for e in entries}
        if time.monotonic() < self._skip_until:
            # skipped: an entry this write should replace may be there (a reader may
            # have filled it meanwhile), so it must become unreachable like a failure's
            self.failures += 1
            self._stale |= parts
            self._schedule_repair()
            return False
        return await self._attempt(lambda: self.cache.put(entries), parts)

    async def _attempt(self, operation: Callable[[], Awaitable[int]], parts: Iterable[int]) -> bool:
        """Run one cache operation after any pending invalidation; on failure, remember
        its partitions to invalidate on return and skip Redis for ``retry_after_s``."""
        try:
            if self._stale:
                await self._bump_stale()
            await operation()
            return True
        except errors.CacheError:
            self._stale |= set(parts)
            self.failures += 1
            self._schedule_repair()
            self._skip_until = time.monotonic() + self.retry_after_s
            return False


async def _nothing() -> int:
    return 0
