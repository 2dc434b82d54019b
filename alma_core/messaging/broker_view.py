"""What the broker says about a topic's logs and a consumer group, for ``alma offsets
reset``: where each partition's log starts and ends, the first offset at or after a
time, the group's members, and Kafka's committed offsets (which it can also move).

* A log's end is the high watermark of a fetch of its last batch: exact on every
  broker (the embedded one answers ListOffsets with the start of its last batch).
* A time is looked up with ListOffsets by timestamp. A broker that does not answer it
  (the embedded one gives timestamp -1) is searched instead: a binary search over the
  records' own timestamps, one single-record fetch per step, which assumes timestamps
  that do not decrease along the log (as Kafka's time index does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from alma_core import errors

PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Log:
    """A partition's log: offsets ``start`` (the first kept) to ``end`` (the next written)."""

    start: int
    end: int

    def clamp(self, offset: int) -> int:
        return min(max(offset, self.start), self.end)


@dataclass(frozen=True)
class Member:
    member_id: str
    client_id: str
    host: str


class BrokerView:
    """An admin client and a group-less consumer on ``bootstrap``, for one command."""

    def __init__(self, bootstrap: str, client_options: dict[str, Any]) -> None:
        self.bootstrap = bootstrap
        self.options = client_options
        self.admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=10_000, **client_options
        )
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            request_timeout_ms=10_000,
            **client_options,
        )

    async def __aenter__(self) -> BrokerView:
        try:
            await self.admin.start()
            await self.consumer.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self.consumer.stop()
        finally:
            await self.admin.close()

    async def cluster_id(self) -> str:
        return str((await self.admin.describe_cluster())["cluster_id"])

    async def topics(self) -> list[str]:
        """Every topic the broker lists to this client."""
        return sorted(await self.admin.list_topics())

    async def partitions(self, topic: str) -> list[int]:
        """The topic's partitions; a missing topic is wrong usage (ConfigError). Listed
        first: describing a missing topic makes a broker that auto-creates create it."""
        listed = set(await self.admin.list_topics())
        described = (await self.admin.describe_topics([topic]))[0] if topic in listed else {}
        if described.get("error_code") or not described.get("partitions"):
            raise errors.ConfigError(
                f"no topic {topic!r} on the broker: check --topic (`alma topics describe` "
                "lists ALMA's topics)"
            )
        return sorted(p["partition"] for p in described["partitions"])

    async def logs(self, topic: str, partitions: list[int]) -> dict[int, Log]:
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer = self.consumer
        starts = await consumer.beginning_offsets(tps)
        listed = await consumer.end_offsets(tps)
        consumer.assign(tps)
        ends = {tp: int(listed[tp]) for tp in tps}
        pending = {tp for tp in tps if listed[tp] > starts[tp]}
        for tp in pending:
            consumer.seek(tp, max(listed[tp] - 1, starts[tp]))
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            await consumer.getmany(*pending, timeout_ms=500, max_records=1)
            for tp in list(pending):
                high = consumer.highwater(tp)
                if high is not None:
                    ends[tp] = max(int(high), ends[tp])
                    pending.discard(tp)
        return {tp.partition: Log(int(starts[tp]), ends[tp]) for tp in tps}

    async def at_time(self, topic: str, logs: dict[int, Log], ts_ms: int) -> dict[int, int]:
        """Each partition's first offset whose record's timestamp is ``ts_ms`` or later
        (the log's end when there is none)."""
        tps = [TopicPartition(topic, p) for p in logs]
        found = await self.consumer.offsets_for_times(dict.fromkeys(tps, ts_ms))
        out: dict[int, int] = {}
        for tp in tps:
            log, answer = logs[tp.partition], found.get(tp)
            if answer is None:
                out[tp.partition] = log.end
            elif answer.timestamp >= 0:
                out[tp.partition] = log.clamp(int(answer.offset))
            else:  # the broker cannot look times up: search the records
                out[tp.partition] = await self._search_time(tp, log, ts_ms)
        return out

    async def _search_time(self, tp: TopicPartition, log: Log, ts_ms: int) -> int:
        lo, hi = log.start, log.end  # records before lo are older; the first at/after hi is not
        while lo < hi:
            mid = (lo + hi) // 2
            record = await self._first_record(tp, mid, hi)
            if record is None or record[1] >= ts_ms:
                hi = mid
            else:
                lo = record[0] + 1
        return lo

    async def _first_record(
        self, tp: TopicPartition, offset: int, below: int
    ) -> tuple[int, int] | None:
        """(offset, timestamp) of the first record at ``offset`` or after, before ``below``."""
        self.consumer.seek(tp, offset)
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while time.monotonic() < deadline:
            batch = await self.consumer.getmany(tp, timeout_ms=500, max_records=1)
            if batch.get(tp):
                record = batch[tp][0]
                return (record.offset, record.timestamp) if record.offset < below else None
            position = await self.consumer.position(tp)
            if position >= below:
                return None
        raise errors.AlmaError(
            f"{tp.topic}[{tp.partition}]: no record came back from offset {offset} in "
            f"{PROBE_TIMEOUT_S:.0f} s while looking for a time; use --to-offset instead"
        )

    async def members(self, group: str) -> list[Member]:
        """The group's members as the broker lists them (empty: no member)."""
        (response,) = await self.admin.describe_consumer_groups([group])
        members: list[Member] = []
        for found in response.groups:
            error_code, group_id, listed = found[0], found[1], found[5]
            if group_id != group:
                continue
            if error_code:
                raise KafkaError(f"DescribeGroups error {error_code} for group {group!r}")
            members.extend(Member(m[0], m[1], m[2]) for m in listed)
        return members

    async def committed(
        self, group: str, topic: str, partitions: list[int]
    ) -> dict[int, int | None]:
        """Kafka's committed offsets of the group (None: none committed)."""
        tps = [TopicPartition(topic, p) for p in partitions]
        found = await self.admin.list_consumer_group_offsets(group, partitions=tps)
        out: dict[int, int | None] = dict.fromkeys(partitions)
        for tp, meta in found.items():
            if meta is not None and meta.offset >= 0:
                out[tp.partition] = int(meta.offset)
        return out

    async def commit(self, group: str, topic: str, offsets: dict[int, int]) -> None:
        """Move Kafka's committed offsets of the group (a commit from outside it, which
        the broker accepts only while the group has no members)."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=group,
            enable_auto_commit=False,
            request_timeout_ms=10_000,
            **self.options,
        )
        await consumer.start()
        try:
            moved = {TopicPartition(topic, p): o for p, o in offsets.items()}
            consumer.assign(list(moved))
            await consumer.commit(moved)
        finally:
            await consumer.stop()


@dataclass(frozen=True)
class Position:
    """Where a group stands in one partition (what ``kafka-consumer-groups --describe``
    shows, with the offset ALMA stored beside the effects)."""

    group: str
    topic: str
    partition: int
    stored: int | None  # what the group's workers resume from
    committed: int | None  # Kafka's committed offset (what lag exporters read)
    log_end: int
    lag: int  # records still to apply
    members: int  # of the group, as the broker lists them


async def positions(
    broker: BrokerView,
    stored: dict[tuple[str, str, int], int],
    groups: dict[str, str],
    *,
    missing: Callable[[str], None],
) -> list[Position]:
    """Every partition of each group (id -> topic) on the broker, with the offsets
    stored for its current cluster (``stored``, by group, topic and partition); a topic
    the broker lacks is told to ``missing``."""
    found, logs = [], {}
    for group, topic in sorted(groups.items()):
        if topic not in logs:
            try:
                logs[topic] = await broker.logs(topic, await broker.partitions(topic))
            except errors.ConfigError:  # not created yet
                missing(f"no topic {topic!r} on the broker yet (`alma topics create`)")
                logs[topic] = {}
        committed = await broker.committed(group, topic, sorted(logs[topic]))
        members = len(await broker.members(group))
        for partition, log in sorted(logs[topic].items()):
            at = stored.get((group, topic, partition), committed[partition])
            applied = log.clamp(log.start if at is None else at)
            found.append(
                Position(
                    group,
                    topic,
                    partition,
                    stored.get((group, topic, partition)),
                    committed[partition],
                    log.end,
                    log.end - applied,
                    members,
                )
            )
    return found
