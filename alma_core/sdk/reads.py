"""What a client reads through: one PostgreSQL pool and the Redis checkpoint cache,
opened on first use (once, however many callers ask at once) and closed together.
The checkpoint reader, the effect waiter, retrieval and the tools read through it."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg

from alma_core import errors
from alma_core.settings import Settings
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.postgres import connect


class ReadConnections:
    def __init__(self, settings: Settings, *, pool_size: int = 4) -> None:
        self.settings = settings
        self.pool_size = pool_size
        self._opening = asyncio.Lock()  # concurrent first reads open one pool, not several
        self._stack: contextlib.AsyncExitStack | None = None
        self._pool: asyncpg.Pool | None = None
        self._cache: RedisCheckpointCache | None = None

    @property
    def opened(self) -> bool:
        return self._stack is not None

    async def pool(self) -> asyncpg.Pool:
        """The pool (opened with the cache on first use)."""
        await self._open()
        assert self._pool is not None
        return self._pool

    async def cache(self) -> RedisCheckpointCache:
        """The checkpoint cache (opened with the pool on first use)."""
        await self._open()
        assert self._cache is not None
        return self._cache

    async def _open(self) -> None:
        async with self._opening:
            if self._stack is not None:
                return
            if not (self.settings.postgres_dsn and self.settings.redis_url):
                raise errors.ConfigError(
                    "reads (resume, applied, retrieve) need ALMA_POSTGRES_DSN and "
                    "ALMA_REDIS_URL (the services of `alma up` are in .alma/endpoints.json)"
                )
            stack = contextlib.AsyncExitStack()
            try:
                self._pool = await stack.enter_async_context(
                    connect(self.settings.postgres_dsn, max_size=self.pool_size)
                )
                self._cache = await stack.enter_async_context(
                    RedisCheckpointCache.for_settings(self.settings)
                )
            except BaseException:
                await stack.aclose()
                raise
            self._stack = stack

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None
