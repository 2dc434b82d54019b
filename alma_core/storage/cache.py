"""RedisCheckpointCache: the latest checkpoint and branch heads of each run.

One hash per run, ``{prefix}:{epoch}:heads:{run key}`` (the run key is the tenant
and the run id, ``<len(tenant)>:<tenant>:<run_id>``: a run is its tenant's), with a
field per
branch head (``@`` for the main line, ``b:<branch_id>`` for branches), a
``latest`` field (the run's highest seq) and a ``complete`` marker set when
all heads were filled from PostgreSQL. Values are ``<seq>:<json>``.

* **Never backwards.** Every write goes through a Lua script that replaces a
  field only when the new seq is higher (guarantee 4).
* **Never stale after an outage.** A writer that failed to write bumps the
  epoch as soon as Redis answers again (a repair task retries it with backoff,
  whether or not another write comes), and every writer bumps it at start (a crash
  during an outage leaves no one who remembers): all older keys become
  unreachable at once and expire by TTL.
* **Never stalls.** Short timeouts, no client retries; callers count the
  failure and fall back to PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from alma_core import errors
from alma_core.types import Checkpoint

MAIN_FIELD = "@"
LATEST_FIELD = "latest"
COMPLETE_FIELD = "complete"

_PUT = """
local epoch = redis.call('GET', KEYS[1]) or '0'
local ttl = tonumber(ARGV[2])
local written = 0
local touched = {}
for i = 4, #ARGV, 4 do
  local key = ARGV[1] .. ':' .. epoch .. ':heads:' .. ARGV[i]
  local seq = tonumber(ARGV[i + 2])
  local cur = redis.call('HGET', key, ARGV[i + 1])
  local cur_seq = -1
  if cur then cur_seq = tonumber(string.match(cur, '^(%d+):')) end
  if seq > cur_seq then
    redis.call('HSET', key, ARGV[i + 1], ARGV[i + 3])
    written = written + 1
  end
  if ARGV[3] == '1' then redis.call('HSET', key, 'complete', '1') end
  touched[key] = true
end
for key, _ in pairs(touched) do redis.call('EXPIRE', key, ttl) end
return written
"""

_GET = """
local epoch = redis.call('GET', KEYS[1]) or '0'
local key = ARGV[1] .. ':' .. epoch .. ':heads:' .. ARGV[2]
if ARGV[3] == '' then return redis.call('HGETALL', key) end
return redis.call('HMGET', key, ARGV[3], 'complete')
"""

_MGET = """
local epoch = redis.call('GET', KEYS[1]) or '0'
local key = ARGV[1] .. ':' .. epoch .. ':heads:' .. ARGV[2]
return redis.call('HMGET', key, unpack(ARGV, 3))
"""

_DELETE = """
local epoch = redis.call('GET', KEYS[1]) or '0'
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('DEL', ARGV[1] .. ':' .. epoch .. ':heads:' .. ARGV[i])
end
return n
"""


def field_for(branch_id: str | None) -> str:
    return MAIN_FIELD if branch_id is None else f"b:{branch_id}"


def branch_of(field: str) -> str | None:
    return None if field == MAIN_FIELD else field[2:]


def run_key(tenant_id: str, run_id: str) -> str:
    """A run's part of its Redis key: unambiguous whatever the tenant contains."""
    return f"{len(tenant_id)}:{tenant_id}:{run_id}"


@dataclass(frozen=True)
class CacheEntry:
    """One cached checkpoint (a JSON object with at least run_id, tenant_id, seq)."""

    tenant_id: str
    run_id: str
    field: str
    seq: int
    document: dict[str, Any]

    @property
    def key(self) -> str:
        return run_key(self.tenant_id, self.run_id)

    def encode(self) -> str:
        return f"{self.seq}:{json.dumps(self.document, separators=(',', ':'))}"


def checkpoint_to_doc(cp: Checkpoint) -> dict[str, Any]:
    return {
        "run_id": cp.run_id,
        "tenant_id": cp.tenant_id,
        "seq": cp.seq,
        "kind": cp.kind,
        "node_id": cp.node_id,
        "branch_id": cp.branch_id,
        "parent_seq": cp.parent_seq,
        "event_id": cp.event_id,
        "state": cp.state,
        "state_hash": cp.state_hash,
        "size_bytes": cp.size_bytes,
        "merged_from": list(cp.merged_from),
        "metadata": cp.metadata,
        "created_at": cp.created_at.isoformat() if cp.created_at else None,
    }


def checkpoint_from_doc(doc: Mapping[str, Any]) -> Checkpoint:
    """A checkpoint from a database row or a cached document (``created_at`` a
    datetime or an ISO string)."""
    created = doc.get("created_at")
    return Checkpoint(
        run_id=doc["run_id"],
        tenant_id=doc["tenant_id"],
        seq=doc["seq"],
        state=doc["state"],
        state_hash=doc["state_hash"],
        size_bytes=doc["size_bytes"],
        kind=doc.get("kind") or "node",
        node_id=doc.get("node_id"),
        branch_id=doc.get("branch_id"),
        parent_seq=doc.get("parent_seq"),
        event_id=doc.get("event_id"),
        merged_from=tuple(doc.get("merged_from") or ()),
        metadata=doc.get("metadata") or {},
        created_at=datetime.fromisoformat(created) if isinstance(created, str) else created,
    )


def cache_entries(heads: Mapping[str | None, Checkpoint]) -> list[CacheEntry]:
    """Entries for a set of branch heads, plus the run's ``latest``."""
    entries = [
        CacheEntry(cp.tenant_id, cp.run_id, field_for(branch), cp.seq, checkpoint_to_doc(cp))
        for branch, cp in heads.items()
    ]
    if heads:
        newest = max(heads.values(), key=lambda cp: cp.seq)
        entries.append(
            CacheEntry(
                newest.tenant_id,
                newest.run_id,
                LATEST_FIELD,
                newest.seq,
                checkpoint_to_doc(newest),
            )
        )
    return entries


def consumed_entries(merge: Checkpoint, branches: Iterable[str]) -> list[CacheEntry]:
    """Tombstones for the branches a join consumed, at the merge's seq: a reader sees
    no head for them (a branch written again later has a higher seq and replaces it)."""
    doc = {"run_id": merge.run_id, "tenant_id": merge.tenant_id, "seq": merge.seq, "consumed": True}
    return [
        CacheEntry(merge.tenant_id, merge.run_id, field_for(b), merge.seq, doc) for b in branches
    ]


def _decode(value: bytes | str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    _, _, body = text.partition(":")
    doc: dict[str, Any] = json.loads(body)
    return doc


class RedisCheckpointCache:
    def __init__(self, client: aioredis.Redis, *, prefix: str, ttl_s: int) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._put = client.register_script(_PUT)
        self._get = client.register_script(_GET)
        self._delete = client.register_script(_DELETE)
        self._mget = client.register_script(_MGET)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls, url: str, *, prefix: str = "alma", ttl_s: int = 7 * 24 * 3600, timeout_s: float = 0.5
    ) -> AsyncIterator[RedisCheckpointCache]:
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        try:
            yield cls(client, prefix=prefix, ttl_s=ttl_s)
        finally:
            await client.aclose()

    @property
    def _epoch_key(self) -> str:
        return f"{self.prefix}:epoch"

    async def bump_epoch(self) -> int:
        """Make every cached entry unreachable (after an outage, at a writer's start)."""
        try:
            return int(await self.client.incr(self._epoch_key))
        except RedisError as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc

    async def put(self, entries: Iterable[CacheEntry], *, complete: bool = False) -> int:
        """Write entries, each only where its seq is higher; returns how many were written."""
        argv: list[str | int] = [self.prefix, self.ttl_s, "1" if complete else "0"]
        for e in entries:
            argv += [e.key, e.field, e.seq, e.encode()]
        if len(argv) == 3:
            return 0
        try:
            return int(await self._put(keys=[self._epoch_key], args=argv))
        except RedisError as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc

    async def delete(self, runs: Iterable[tuple[str, str]]) -> int:
        """Forget runs, (tenant, run id) each (their checkpoints were deleted); returns
        how many were cached."""
        argv = [self.prefix, *(run_key(t, r) for t, r in runs)]
        if len(argv) == 1:
            return 0
        try:
            return int(await self._delete(keys=[self._epoch_key], args=argv))
        except RedisError as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc

    async def get(
        self, tenant_id: str, run_id: str, field: str
    ) -> tuple[dict[str, Any] | None, bool]:
        """(the entry or None, whether the run's heads are complete in the cache). A
        branch a join consumed is None when the heads are complete (it has no head)."""
        try:
            value, complete = await self._get(
                keys=[self._epoch_key], args=[self.prefix, run_key(tenant_id, run_id), field]
            )
        except RedisError as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc
        doc = _decode(value)
        if doc is not None and doc.get("consumed"):
            doc = None
        return doc, complete is not None

    async def entries(
        self, tenant_id: str, run_id: str, fields: list[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """The run's entries for ``fields`` (None: all of them) that the cache holds (a
        consumed branch's tombstone included: its seq is not a head's, so a reader
        never takes it)."""
        key = run_key(tenant_id, run_id)
        try:
            if fields is None:
                flat = await self._get(keys=[self._epoch_key], args=[self.prefix, key, ""])
                names = [k.decode() if isinstance(k, bytes) else k for k in flat[::2]]
                pairs = [
                    (f, v) for f, v in zip(names, flat[1::2], strict=True) if f != COMPLETE_FIELD
                ]
            else:
                values = await self._mget(keys=[self._epoch_key], args=[self.prefix, key, *fields])
                pairs = list(zip(fields, values, strict=True))
        except RedisError as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc
        return {f: doc for f, v in pairs if (doc := _decode(v)) is not None}

    async def heads(self, tenant_id: str, run_id: str) -> dict[str, dict[str, Any]] | None:
        """Every cached head of the run, or None unless the cache holds all of them."""
        try:
            flat = await self._get(
                keys=[self._epoch_key], args=[self.prefix, run_key(tenant_id, run_id), ""]
            )
        except RedisError as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc
        fields = {
            (k.decode() if isinstance(k, bytes) else k): v
            for k, v in zip(flat[::2], flat[1::2], strict=True)
        }
        if COMPLETE_FIELD not in fields:
            return None
        return {
            f: doc
            for f, v in fields.items()
            if f not in (COMPLETE_FIELD, LATEST_FIELD)
            and (doc := _decode(v)) is not None
            and not doc.get("consumed")
        }


class CacheWriter:
    """The writers' side: count failures, skip Redis while it is down, and bump the
    epoch when it answers again so nothing written before the outage is served."""

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
        self._dirty = True  # a fresh writer cannot know what happened before it
        self._skip_until = 0.0
        self._repair: asyncio.Task[None] | None = None
        self.failures = 0

    async def open(self) -> None:
        """Bump the epoch before this writer's first checkpoint: a predecessor that died
        during an outage may have left entries behind. If Redis is down now, the
        bump happens with the first write that succeeds."""
        try:
            await self.cache.bump_epoch()
            self._dirty = False
        except errors.CacheError:
            self.failures += 1
            self._schedule_repair()

    async def close(self) -> None:
        """Stop the repair task (a bump still pending happens at the next start)."""
        if self._repair is not None:
            self._repair.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._repair
            self._repair = None

    def _schedule_repair(self) -> None:
        """After a failed write Redis may still serve the entry that write should have
        replaced: bump the epoch as soon as Redis answers, not at this writer's next
        write (there may be none: the run's last event)."""
        if self._repair is None or self._repair.done():
            self._repair = asyncio.create_task(self._repair_loop())

    async def _repair_loop(self) -> None:
        delay = self.retry_after_s
        while self._dirty:
            await asyncio.sleep(delay)
            try:
                await self.cache.bump_epoch()
                self._dirty = False
            except errors.CacheError:
                delay = min(delay * 2, self.repair_max_s)

    @property
    def degraded(self) -> bool:
        return self._dirty and self.failures > 0

    async def forget(self, runs: list[tuple[str, str]]) -> bool:
        """Drop runs whose checkpoints were deleted; when Redis is down, the epoch bump
        on its return makes the old entries unreachable all the same."""
        return await self._attempt(lambda: self.cache.delete(runs))

    async def write(self, entries: list[CacheEntry]) -> bool:
        """True when written; False when Redis is down (counted, never raised)."""
        if time.monotonic() < self._skip_until:
            # skipped: an entry this write should replace may be there (a reader may
            # have filled it meanwhile), so it must become unreachable like a failure's
            self.failures += 1
            self._dirty = True
            self._schedule_repair()
            return False
        return await self._attempt(lambda: self.cache.put(entries))

    async def _attempt(self, operation: Callable[[], Awaitable[int]]) -> bool:
        """Run one cache operation after any pending epoch bump; on failure, remember
        to bump on return and skip Redis for ``retry_after_s``."""
        try:
            if self._dirty:
                await self.cache.bump_epoch()
                self._dirty = False
            await operation()
            return True
        except errors.CacheError:
            self._dirty = True
            self.failures += 1
            self._schedule_repair()
            self._skip_until = time.monotonic() + self.retry_after_s
            return False
