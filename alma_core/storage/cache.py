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
from collections.abc import AsyncIterator, Awaitable, Iterable
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
from alma_core.storage.cache_entries import COMPLETE_FIELD, LATEST_FIELD, CacheEntry, decode_value

# What the Redis client raises when a server goes away under a command: its own errors,
# the socket's, and the AttributeError or TypeError of a connection torn down while a
# command was being sent (redis-py races: redis/redis-py#3546, #3835; seen here with a
# cluster node stopped). Each is a cache failure: counted, never the pipeline's.
CLIENT_FAILURES: tuple[type[Exception], ...] = (RedisError, OSError, AttributeError, TypeError)

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


def run_key(tenant_id: str, run_id: str) -> str:
    """A run's part of its Redis key: unambiguous whatever the tenant contains."""
    return f"{len(tenant_id)}:{tenant_id}:{run_id}"


def partition_key(prefix: str, partition: int, name: str) -> str:
    """A key of cache partition ``partition``: ``epoch``, ``h:<run key>`` (a run's
    hash), ``inflight:<run key>`` (its writes in flight, :mod:`.inflight`)."""
    return f"{{{prefix}:{partition}}}:{name}"


def _glob_escaped(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def tenant_key_patterns(prefix: str, tenant_id: str, partitions: int) -> list[str]:
    """The Redis key patterns (ACL ``~pattern``) a tenant's own orchestrator needs: its
    runs' hashes and in-flight marks, and the partitions' epochs every cache read checks
    (Redis 6 cannot make those read-only: a tenant that bumps one costs the others cache
    hits, never a wrong read). Exact per partition, so no other tenant's key matches."""
    own = _glob_escaped(run_key(tenant_id, ""))
    return [
        partition_key(prefix, p, name)
        for p in range(partitions)
        for name in ("epoch", f"h:{own}*", f"inflight:{own}*")
    ]


# What a tenant's orchestrator runs on Redis: reads and writes of its keys, the cache's
# scripts, the transactions of its marks; nothing of the server's administration.
TENANT_COMMANDS = (
    "-@all",
    "+@read",
    "+@write",
    "+@scripting",
    "+@transaction",
    "+@connection",
    "-@dangerous",
)


def tenant_acl_rules(prefix: str, tenant_id: str, partitions: int) -> list[str]:
    """The rules of ``ACL SETUSER USER RULES...`` for a tenant's own Redis user (its
    password is the operator's to add: ``>password``)."""
    patterns = tenant_key_patterns(prefix, tenant_id, partitions)
    return ["on", "resetkeys", "resetchannels", *TENANT_COMMANDS, *(f"~{p}" for p in patterns)]


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
        return partition_key(self.prefix, partition, "epoch")

    def _key(self, tenant_id: str, run_id: str) -> tuple[int, str]:
        p = self.partition(run_id)
        return p, partition_key(self.prefix, p, f"h:{run_key(tenant_id, run_id)}")

    async def bump_epoch(self, partitions: Iterable[int] | None = None) -> None:
        """Make the cached entries of these partitions (None: all) unreachable."""
        chosen = range(self.partitions) if partitions is None else sorted(set(partitions))
        await self._commands([("INCR", (self._epoch_key(p),)) for p in chosen])

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
        deleted = await self._commands([("DEL", tuple(keys)) for keys in groups.values()])
        return sum(int(n) for n in deleted)

    async def _commands(self, calls: list[tuple[str, tuple[str, ...]]]) -> list[Any]:
        """Commands of different partitions: on one Redis, one round trip on one
        connection (a pipeline, no transaction); on a cluster, at once, each to its
        slot's node. One connection matters: a rebalance invalidates every partition,
        and twelve connections opened at once on a busy host missed the 0.5 s connect
        timeout where one did not (CI, 2026-12-06)."""
        if isinstance(self.client, RedisCluster) or len(calls) < 2:
            return await self._each(
                self.client.execute_command(name, *args) for name, args in calls
            )
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for name, args in calls:
                    pipe.execute_command(name, *args)
                return list(await pipe.execute())
        except CLIENT_FAILURES as exc:
            raise errors.CacheError(f"Redis: {exc!r}") from exc

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
        doc = decode_value(value)
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
        return {f: doc for f, v in pairs if (doc := decode_value(v)) is not None}

    async def heads(self, tenant_id: str, run_id: str) -> dict[str, dict[str, Any]] | None:
        """Every cached head of the run, or None unless the cache holds all of them."""
        fields = await self._all(tenant_id, run_id)
        if COMPLETE_FIELD not in fields:
            return None
        return {
            f: doc
            for f, v in fields.items()
            if f not in (COMPLETE_FIELD, LATEST_FIELD)
            and (doc := decode_value(v)) is not None
            and not doc.get("consumed")
        }
