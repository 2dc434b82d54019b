"""RedisCheckpointCache: the latest checkpoint and branch heads of each run, on one
Redis or a Redis Cluster.

**Layout.** Runs are spread over cache partitions: Kafka's own partition of the run
(``murmur2(run_id) % ALMA_PARTITIONS``, what the producer chose when the topic has
ALMA_PARTITIONS partitions). Each partition has an epoch key ``{<prefix>:<p>}:epoch``,
and each run one hash ``{<prefix>:<p>}:h:<run key>`` (the run key is the tenant and
the run id, ``<len(tenant)>:<tenant>:<run_id>``: a run is its tenant's). The braces
are a Redis Cluster hash tag: a partition's keys share a slot, so every script
declares all the keys it touches and runs on one node. Fields: one per branch head
(``@`` for the main line, ``b:<branch_id>`` for branches), ``latest`` (the run's
highest seq), ``complete`` (set when all heads were filled from PostgreSQL) and
``_e`` (the partition epoch the hash was written under). Values are
``<seq>:<json>``.

* **Never backwards.** Every write goes through a Lua script that replaces a
  field only when the new seq is higher (docs/guarantees.md §4), or the same with
  another value (the run moved to a new projection: ``alma replay --apply``; readers
  serve an entry only while its seq and hash are PostgreSQL's head's).
* **Invalidation by partition.** A hash written under an older epoch of its
  partition is empty to readers and emptied by the next write. A writer bumps the
  epochs of the partitions newly assigned to it (a member that died may have left
  entries its successor's writes would not replace): a rebalance or a rolling
  deploy invalidates what moved, not the whole cache. A writer that failed to
  write bumps the partitions of what it failed to write as soon as Redis answers.
* **Never stalls.** Short timeouts, no client retries; callers count the failure
  and fall back to PostgreSQL (readers check every entry against PostgreSQL's
  heads anyway: :mod:`alma_core.storage.reader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlparse

import redis.asyncio as aioredis
from aiokafka.partitioner import murmur2
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from alma_core import errors
from alma_core.settings import Settings
from alma_core.types import Checkpoint
from schemas import jsoncodec

# What the Redis client raises when a server goes away under a command: its own errors,
# the socket's, and the AttributeError or TypeError of a connection torn down while a
# command was being sent (redis-py races: redis/redis-py#3546, #3835; seen here with a
# cluster node stopped). Each is a cache failure: counted, never the pipeline's.
CLIENT_FAILURES: tuple[type[Exception], ...] = (RedisError, OSError, AttributeError, TypeError)

MAIN_FIELD = "@"
LATEST_FIELD = "latest"
COMPLETE_FIELD = "complete"

EPOCH_FIELD = "_e"

# Every script: KEYS[1] the partition's epoch, KEYS[2..] run hashes of that partition.
_FRESH = """
local epoch = redis.call('GET', KEYS[1]) or '0'
local function fresh(key) return redis.call('HGET', key, '_e') == epoch end
"""

_PUT = (
    _FRESH
    + """
local ttl = tonumber(ARGV[1])
for k = 2, #KEYS do
  if not fresh(KEYS[k]) then
    redis.call('DEL', KEYS[k])
    redis.call('HSET', KEYS[k], '_e', epoch)
  end
end
local written = 0
for i = 3, #ARGV, 4 do
  local key = KEYS[tonumber(ARGV[i])]
  local seq = tonumber(ARGV[i + 2])
  local cur = redis.call('HGET', key, ARGV[i + 1])
  local cur_seq = -1
  if cur then cur_seq = tonumber(string.match(cur, '^(%d+):')) end
  if seq > cur_seq or (seq == cur_seq and cur ~= ARGV[i + 3]) then
    redis.call('HSET', key, ARGV[i + 1], ARGV[i + 3])
    written = written + 1
  end
end
for k = 2, #KEYS do
  if ARGV[2] == '1' then redis.call('HSET', KEYS[k], 'complete', '1') end
  redis.call('EXPIRE', KEYS[k], ttl)
end
return written
"""
)

_GET = (
    _FRESH
    + """
if not fresh(KEYS[2]) then return {} end
if #ARGV == 0 then return redis.call('HGETALL', KEYS[2]) end
return redis.call('HMGET', KEYS[2], unpack(ARGV))
"""
)


def field_for(branch_id: str | None) -> str:
    return MAIN_FIELD if branch_id is None else f"b:{branch_id}"


def run_key(tenant_id: str, run_id: str) -> str:
    """A run's part of its Redis key: unambiguous whatever the tenant contains."""
    return f"{len(tenant_id)}:{tenant_id}:{run_id}"


@dataclass(frozen=True)
class CacheEntry:
    """One cached checkpoint (a JSON object with at least run_id, tenant_id, seq).
    ``state_json``: the document's ``state`` already as JSON text (the checkpointer's
    canonical state), spliced in rather than encoded again. ``encoded``: the stored
    value, ``<seq>:<json>``, made once (a head and ``latest`` share it)."""

    tenant_id: str
    run_id: str
    field: str
    seq: int
    document: dict[str, Any]
    state_json: str | None = None
    encoded: str = ""

    def __post_init__(self) -> None:
        if not self.encoded:
            object.__setattr__(
                self, "encoded", encode_value(self.seq, self.document, self.state_json)
            )

    def encode(self) -> str:
        return self.encoded


def encode_value(seq: int, document: Mapping[str, Any], state_json: str | None = None) -> str:
    """A cached value: ``<seq>:<document as compact JSON>``, the state spliced in when
    given as text (the same JSON value, its keys in canonical order)."""
    if state_json is None or "state" not in document:
        return f"{seq}:{jsoncodec.compact(document).decode()}"
    rest = jsoncodec.compact({k: v for k, v in document.items() if k != "state"}).decode()
    head = rest[:-1] + "," if rest != "{}" else "{"
    return f'{seq}:{head}"state":{state_json}}}'


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


def cache_entries(
    heads: Mapping[str | None, Checkpoint], state_json: Mapping[str | None, str] | None = None
) -> list[CacheEntry]:
    """Entries for a set of branch heads, plus the run's ``latest`` (the newest head's
    value, encoded once). ``state_json``: heads' states already as JSON, by branch."""
    texts = state_json or {}
    entries = [
        CacheEntry(
            cp.tenant_id,
            cp.run_id,
            field_for(branch),
            cp.seq,
            checkpoint_to_doc(cp),
            texts.get(branch),
        )
        for branch, cp in heads.items()
    ]
    if entries:
        newest = max(entries, key=lambda e: e.seq)
        entries.append(
            CacheEntry(
                newest.tenant_id,
                newest.run_id,
                LATEST_FIELD,
                newest.seq,
                newest.document,
                newest.state_json,
                newest.encoded,
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
    raw = value if isinstance(value, bytes) else value.encode()
    _, _, body = raw.partition(b":")
    doc: dict[str, Any] = jsoncodec.parse(body)
    return doc


@functools.lru_cache(maxsize=65_536)
def partition_of(run_id: str, partitions: int) -> int:
    """The run's partition as Kafka's default partitioner picks it for the key
    ``run_id`` (murmur2, the Java client's and aiokafka's)."""
    return int(murmur2(run_id.encode()) & 0x7FFFFFFF) % partitions


class RedisCheckpointCache:
    def __init__(
        self, client: aioredis.Redis | RedisCluster, *, prefix: str, ttl_s: int, partitions: int
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.partitions = partitions
        self._put = client.register_script(_PUT)
        self._get = client.register_script(_GET)
        # A cluster client learns the slots on its first command; several first commands
        # at once race in redis-py (connections closed under them): one learns, first.
        self._learned = not isinstance(client, RedisCluster)
        self._learning = asyncio.Lock()

    async def ready(self) -> None:
        """Learn a cluster's slots once, before the first command (a no-op otherwise)."""
        if not self._learned:
            async with self._learning:
                if not self._learned:
                    assert isinstance(self.client, RedisCluster)
                    await self.client.initialize()
                    self._learned = True

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        url: str,
        *,
        prefix: str = "alma",
        ttl_s: int = 7 * 24 * 3600,
        timeout_s: float = 0.5,
        cluster: bool = False,
        partitions: int = 12,
    ) -> AsyncIterator[RedisCheckpointCache]:
        """``cluster``: ``url`` names one node of a Redis Cluster, or several
        (comma-separated URLs); the others are found from them. ``partitions``:
        ALMA_PARTITIONS, the lifecycle topic's partitions."""
        client: aioredis.Redis | RedisCluster
        if cluster:
            # several nodes, comma-separated: the client starts from any that answers
            first, *others = [u.strip() for u in url.split(",")]
            seeds = [urlparse(u) for u in others]
            client = RedisCluster.from_url(
                first,
                startup_nodes=[ClusterNode(u.hostname or "", u.port or 6379) for u in seeds]
                or None,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        else:
            client = aioredis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        try:
            yield cls(client, prefix=prefix, ttl_s=ttl_s, partitions=partitions)
        finally:
            await client.aclose()

    @classmethod
    def for_settings(
        cls, settings: Settings, url: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[RedisCheckpointCache]:
        """The cache as the settings describe it (``url``: a running ``alma up``'s)."""
        return cls.connect(
            url or settings.redis_url or "",
            prefix=settings.redis_prefix,
            ttl_s=settings.cache_ttl_seconds,
            cluster=settings.redis_cluster,
            partitions=settings.partitions,
        )

    def partition(self, run_id: str) -> int:
        return partition_of(run_id, self.partitions)

    def _epoch_key(self, partition: int) -> str:
        return f"{{{self.prefix}:{partition}}}:epoch"

    def _key(self, tenant_id: str, run_id: str) -> tuple[int, str]:
        p = self.partition(run_id)
        return p, f"{{{self.prefix}:{p}}}:h:{run_key(tenant_id, run_id)}"

    async def bump_epoch(self, partitions: Iterable[int] | None = None) -> None:
        """Make the cached entries of these partitions (None: all) unreachable."""
        chosen = range(self.partitions) if partitions is None else sorted(set(partitions))
        await self._each(self.client.incr(self._epoch_key(p)) for p in chosen)

    async def put(self, entries: Iterable[CacheEntry], *, complete: bool = False) -> int:
        """Write entries, each only where its seq is higher; returns how many were written.
        One script per partition (its keys share a slot)."""
        # per partition: its keys (the epoch first, each run's hash once, by position) and args
        groups: dict[int, tuple[dict[str, int], list[str | int]]] = {}
        for e in entries:
            p, key = self._key(e.tenant_id, e.run_id)
            keys, argv = groups.setdefault(
                p, ({self._epoch_key(p): 1}, [self.ttl_s, "1" if complete else "0"])
            )
            position = keys.setdefault(key, len(keys) + 1)
            argv += [position, e.field, e.seq, e.encode()]
        calls = [(list(k), a) for k, a in groups.values()]
        if isinstance(self.client, RedisCluster) or len(calls) < 2:
            written = await self._each(self._put(keys=k, args=a) for k, a in calls)
        else:
            written = await self._pipelined(calls)
        return sum(int(n) for n in written)

    async def _pipelined(self, calls: list[tuple[list[str], list[str | int]]]) -> list[Any]:
        """Every partition's script in one round trip (one Redis, not a cluster); a call
        the server does not know the script for (restarted, flushed) is made again alone,
        loading it."""
        assert isinstance(self.client, aioredis.Redis)
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    pipe.evalsha(self._put.sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
            out = []
            for (keys, args), result in zip(calls, results, strict=True):
                if isinstance(result, NoScriptError):
                    result = await self._put(keys=keys, args=args)
                elif isinstance(result, Exception):
                    raise result
                out.append(result)
            return out
        except CLIENT_FAILURES as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc

    async def delete(self, runs: Iterable[tuple[str, str]]) -> int:
        """Forget runs, (tenant, run id) each (their checkpoints were deleted); returns
        how many were cached. One DEL per partition (its keys share a slot)."""
        groups: dict[int, list[str]] = {}
        for tenant, run in runs:
            p, key = self._key(tenant, run)
            groups.setdefault(p, []).append(key)
        deleted = await self._each(self.client.delete(*keys) for keys in groups.values())
        return sum(int(n) for n in deleted)

    async def _each(self, commands: Iterable[Awaitable[Any]]) -> list[Any]:
        """Commands of different partitions at once (each goes to its slot's node); made
        only once the client is ready, so a failure leaves none unawaited."""
        try:
            await self.ready()
            return list(await asyncio.gather(*commands))
        except CLIENT_FAILURES as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc

    async def _read(self, tenant_id: str, run_id: str, fields: list[str]) -> list[Any]:
        """HMGET of ``fields`` (empty: HGETALL) of a fresh hash; [] when it is stale."""
        p, key = self._key(tenant_id, run_id)
        try:
            await self.ready()
            return list(await self._get(keys=[self._epoch_key(p), key], args=fields))
        except CLIENT_FAILURES as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc

    async def get(
        self, tenant_id: str, run_id: str, field: str
    ) -> tuple[dict[str, Any] | None, bool]:
        """(the entry or None, whether the run's heads are complete in the cache). A
        branch a join consumed is None when the heads are complete (it has no head)."""
        found = await self._read(tenant_id, run_id, [field, COMPLETE_FIELD])
        value, complete = found or (None, None)
        doc = _decode(value)
        if doc is not None and doc.get("consumed"):
            doc = None
        return doc, complete is not None

    async def _all(self, tenant_id: str, run_id: str) -> dict[str, Any]:
        flat = await self._read(tenant_id, run_id, [])
        names = [k.decode() if isinstance(k, bytes) else k for k in flat[::2]]
        return {k: v for k, v in zip(names, flat[1::2], strict=True) if k != EPOCH_FIELD}

    async def entries(
        self, tenant_id: str, run_id: str, fields: list[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """The run's entries for ``fields`` (None: all of them) that the cache holds (a
        consumed branch's tombstone included: its seq is not a head's, so a reader
        never takes it)."""
        if fields is None:
            found = await self._all(tenant_id, run_id)
            pairs = [(f, v) for f, v in found.items() if f != COMPLETE_FIELD]
        else:
            values = await self._read(tenant_id, run_id, fields) if fields else []
            pairs = list(zip(fields, values, strict=False))  # [] when the hash is stale
        return {f: doc for f, v in pairs if (doc := _decode(v)) is not None}

    async def heads(self, tenant_id: str, run_id: str) -> dict[str, dict[str, Any]] | None:
        """Every cached head of the run, or None unless the cache holds all of them."""
        fields = await self._all(tenant_id, run_id)
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
