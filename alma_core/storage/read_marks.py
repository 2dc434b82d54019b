"""How far a consumer group has read each partition, whoever read it: the mark that
tells a redelivered record from a first delivery, for its span (``alma.redelivery``).

A consumer's position is stored with its effects (:mod:`alma_core.storage.offsets`),
so a record read and not committed (the member died, or lost the partition, between
its fetch and its commit) is read again by the next owner, which cannot tell it from a
new one. While traces are on, each member marks, before it applies a batch, the offset
it has read up to, in Redis: one hash per group, a field per partition, raised only
(a Lua ``max``), so a member that starts again lower never hides an earlier reading.
A partition's new owner reads the marks when it is assigned; its records below the
mark were delivered before. One round trip per batch, made while the batch is
prepared and applied, and none with traces off. Redis down: no marks, and the spans
say nothing of redelivery rather than something false.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from redis.exceptions import RedisError

from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.offsets import PartitionKey

log = logging.getLogger("alma.read_marks")

TTL_S = 7 * 24 * 3600  # a group idle this long starts afresh

_RAISE = """
for i = 1, #ARGV - 1, 2 do
  local now = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '-1')
  if tonumber(ARGV[i + 1]) > now then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[#ARGV])
return 1
"""


class RedisReadMarks:
    def __init__(self, cache: RedisCheckpointCache, group: str) -> None:
        """The marks of ``group``, kept beside (and connected as) the checkpoint cache."""
        self.cache = cache
        self.client = cache.client
        self.key = f"{{{cache.prefix}:reads}}:{group}"
        self._raise = self.client.register_script(_RAISE)

    @staticmethod
    def _field(tp: PartitionKey) -> str:
        return f"{tp[0]}:{tp[1]}"

    async def load(self, partitions: Sequence[PartitionKey]) -> dict[PartitionKey, int] | None:
        """Each partition's mark (the next offset any member had read to); none for a
        partition no member read while traces were on (within the marks' TTL); None when
        Redis does not answer (nothing is known)."""
        if not partitions:
            return {}
        try:
            await self.cache.ready()
            values = await self.client.hmget(self.key, [self._field(tp) for tp in partitions])
        except (RedisError, OSError) as exc:
            log.info(
                "read marks unavailable; spans will not say which records are redelivered",
                extra={"action": "read_marks_unavailable", "error": repr(exc)},
            )
            return None
        return {tp: int(v) for tp, v in zip(partitions, values, strict=True) if v is not None}

    async def mark(self, read_to: Mapping[PartitionKey, int]) -> None:
        """Raise the marks to ``read_to`` (each partition's next offset to read)."""
        if not read_to:
            return
        args: list[str | int] = []
        for tp, offset in read_to.items():
            args += [self._field(tp), offset]
        try:
            await self.cache.ready()
            await self._raise(keys=[self.key], args=[*args, TTL_S])
        except (RedisError, OSError):
            pass  # the marks say less for a while (see load); nothing else depends on them
