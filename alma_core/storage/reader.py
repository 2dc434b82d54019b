"""The resume API: where a crashed run picks up. Redis first, PostgreSQL on a miss.

Every read is scoped to one tenant (guarantee 6): a run of another tenant is
"not found", from the cache and from PostgreSQL alike. A reader built without
a tenant is an operator's reader and exists only when multi-tenant mode is off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import asyncpg

from alma_core import errors
from alma_core.storage.cache import (
    LATEST_FIELD,
    MAIN_FIELD,
    RedisCheckpointCache,
    branch_of,
    cache_entries,
    checkpoint_from_doc,
)
from alma_core.storage.observer import ReadMetrics, ReadObserver
from alma_core.storage.postgres import is_storage_failure, storage_error
from alma_core.types import Checkpoint

_COLUMNS = """run_id, tenant_id, seq, kind, node_id, branch_id, parent_seq, event_id, state,
              state_hash, size_bytes, merged_from, metadata, created_at"""


class CheckpointReader:
    """Reads of one tenant's checkpoints; each cache lookup is reported to ``observer``
    (default: this process's :class:`~alma_core.storage.observer.ReadMetrics`)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        cache: RedisCheckpointCache | None,
        *,
        tenant_id: str | None,
        require_tenant: bool = True,
        observer: ReadObserver | None = None,
    ) -> None:
        if require_tenant and not tenant_id:
            raise errors.ContextError(
                "a tenant is required to read checkpoints (ALMA_REQUIRE_TENANT=true); "
                "pass --tenant / tenant_id"
            )
        self.pool = pool
        self.cache = cache
        self.tenant_id = tenant_id
        self.observer = observer or ReadMetrics.shared()

    def _mine(self, doc: Mapping[str, Any] | None) -> bool:
        return doc is not None and (self.tenant_id is None or doc["tenant_id"] == self.tenant_id)

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        try:
            rows: list[asyncpg.Record] = await self.pool.fetch(sql, *args)
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, "reading checkpoints") from exc
            raise
        return rows

    async def _cache_get(self, run_id: str, field: str) -> dict[str, Any] | None:
        if self.cache is None:
            return None
        try:
            doc, _ = await self.cache.get(run_id, field)
        except errors.CacheError:
            self.observer.cache_read("error")
            return None
        self.observer.cache_read("miss" if doc is None else "hit")
        return doc

    async def _fill(self, heads: Mapping[str | None, Checkpoint]) -> None:
        if self.cache is None or not heads:
            return
        try:
            await self.cache.put(cache_entries(heads), complete=True)
        except errors.CacheError:
            self.observer.cache_read("error")

    async def _heads_from_db(self, run_id: str) -> dict[str | None, Checkpoint]:
        rows = await self._fetch(
            f"""SELECT {_COLUMNS} FROM checkpoints c
                WHERE (c.run_id, c.seq) IN (SELECT run_id, seq FROM run_heads WHERE run_id = $1)
                  AND ($2::text IS NULL OR c.tenant_id = $2)""",
            run_id,
            self.tenant_id,
        )
        heads = {r["branch_id"]: checkpoint_from_doc(r) for r in rows}
        await self._fill(heads)
        return heads

    async def latest(self, run_id: str) -> Checkpoint | None:
        """The run's newest checkpoint (highest seq, any branch)."""
        doc = await self._cache_get(run_id, LATEST_FIELD)
        if self._mine(doc):
            assert doc is not None
            return checkpoint_from_doc(doc)
        if doc is not None:
            return None  # another tenant's run
        heads = await self._heads_from_db(run_id)
        return max(heads.values(), key=lambda cp: cp.seq) if heads else None

    async def branch_heads(self, run_id: str) -> dict[str | None, Checkpoint]:
        """The head of every branch of the run; the main line under ``None``."""
        if self.cache is not None:
            try:
                cached = await self.cache.heads(run_id)
            except errors.CacheError:
                self.observer.cache_read("error")
                cached = None
            if cached is not None:
                self.observer.cache_read("hit")
                if not all(self._mine(d) for d in cached.values()):
                    return {}
                return {branch_of(f): checkpoint_from_doc(d) for f, d in cached.items()}
            self.observer.cache_read("miss")
        return await self._heads_from_db(run_id)

    async def main_head(self, run_id: str) -> Checkpoint | None:
        doc = await self._cache_get(run_id, MAIN_FIELD)
        if doc is not None:
            return checkpoint_from_doc(doc) if self._mine(doc) else None
        return (await self._heads_from_db(run_id)).get(None)

    async def history(
        self, run_id: str, *, limit: int = 100, before_seq: int | None = None
    ) -> list[Checkpoint]:
        """Checkpoints newest first, ``limit`` at most, below ``before_seq`` when given."""
        rows = await self._fetch(
            f"""SELECT {_COLUMNS} FROM checkpoints
                WHERE run_id = $1 AND ($2::text IS NULL OR tenant_id = $2)
                  AND ($3::bigint IS NULL OR seq < $3)
                ORDER BY seq DESC LIMIT $4""",
            run_id,
            self.tenant_id,
            before_seq,
            max(1, min(limit, 10_000)),
        )
        return [checkpoint_from_doc(r) for r in rows]

    async def get(self, run_id: str, seq: int) -> Checkpoint | None:
        rows = await self._fetch(
            f"""SELECT {_COLUMNS} FROM checkpoints
                WHERE run_id = $1 AND seq = $2 AND ($3::text IS NULL OR tenant_id = $3)""",
            run_id,
            seq,
            self.tenant_id,
        )
        return checkpoint_from_doc(rows[0]) if rows else None

    async def state_has(self, run_id: str, key: str) -> bool:
        """Has the run's main-line state got ``key``? (the idempotency check)."""
        head = await self.main_head(run_id)
        return head is not None and key in head.state
