"""Consumer offsets stored in PostgreSQL with the effects, fenced by a row lock.

Every consumer group that writes to PostgreSQL applies a polled batch the same
way: :func:`fence` at the start of its transaction, :func:`advance` at the end (the
checkpointer runs :data:`ADVANCE` inside its write statement instead).

* Records below a partition's stored ``next_offset`` were already applied (by
  this member before a crash, or by another member): they are dropped.
* A batch that starts after the stored ``next_offset`` is a gap. If the consumer read
  the batch from the stored offset or before it (each record says where its read
  began: ``read_from``), the log holds no record in between (a transaction's commit
  marker, records removed by retention or compaction): the batch is applied and the
  hole reported (``holes``). Otherwise the partition is sent back to the stored
  offset (``seeks``) for what it has not read.
* The rows are locked (an upsert whose no-op update takes the row lock): two
  members that both think they own a partition serialise here, and the second
  finds its records applied. A zombie's late writes have no effect.
* Offsets are keyed by the broker's cluster id, so offsets of one log are never
  applied to another (the embedded broker starts empty, with a new id, each time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

import asyncpg

from alma_core.storage.postgres import columns

PartitionKey = tuple[str, int]  # (topic, partition): a plain key, not aiokafka's TopicPartition


class HasOffset(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def read_from(self) -> int | None:
        """The consumer's position when it read this record (None: not known)."""


R = TypeVar("R", bound=HasOffset)


@dataclass(frozen=True)
class Progress:
    """Where a batch leaves each partition: the one result a consumer acts on. Next
    offsets to store and commit, partitions to send back (``seeks``: records of them
    were not read yet), records dropped as applied before, holes of the log moved past
    (``[from, to)``: offsets that hold no record)."""

    next_offsets: dict[PartitionKey, int] = field(default_factory=dict)
    seeks: dict[PartitionKey, int] = field(default_factory=dict)
    already_applied: int = 0
    holes: dict[PartitionKey, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, parts: Sequence[Progress]) -> Progress:
        """The progress of a batch applied in parts (disjoint partitions)."""
        if len(parts) == 1:
            return parts[0]
        out = cls()
        for part in parts:
            out.next_offsets.update(part.next_offsets)
            out.seeks.update(part.seeks)
            out.holes.update(part.holes)
        return replace(out, already_applied=sum(p.already_applied for p in parts))


@dataclass(frozen=True)
class Fence(Generic[R]):
    """A batch once its partitions' offset rows are locked: the records new to the
    group (``fresh``), and the progress of the rest."""

    fresh: dict[PartitionKey, list[R]]
    progress: Progress

    def progress_after(self) -> Progress:
        """The progress once every record in ``fresh`` is applied."""
        return replace(
            self.progress, next_offsets={**self.progress.next_offsets, **ends(self.fresh)}
        )


async def stored_offsets(
    conn: asyncpg.Connection | asyncpg.Pool,
    group_id: str,
    cluster_id: str,
    partitions: Sequence[PartitionKey],
) -> dict[PartitionKey, int]:
    rows = await conn.fetch(
        """SELECT topic, partition, next_offset FROM consumer_offsets
           WHERE group_id = $1 AND cluster_id = $2
             AND (topic, partition) IN (SELECT * FROM unnest($3::text[], $4::int[]))""",
        group_id,
        cluster_id,
        *columns(partitions, 2),
    )
    return {(r["topic"], r["partition"]): r["next_offset"] for r in rows}


# The fence with its placeholders named, so a store can run it as a CTE of a statement
# of its own (:mod:`alma_core.storage.locked`); :func:`fence_args` gives its values.
FENCE = """INSERT INTO consumer_offsets (group_id, cluster_id, topic, partition, next_offset)
   SELECT {group}, {cluster}, t, p, o
   FROM unnest({topics}::text[], {partitions}::int[], {firsts}::bigint[]) AS u(t, p, o)
   ON CONFLICT (group_id, cluster_id, topic, partition)
   DO UPDATE SET next_offset = consumer_offsets.next_offset
   RETURNING topic, partition, next_offset, xmax = 0 AS inserted"""

_FENCE_ALONE = FENCE.format(group="$1", cluster="$2", topics="$3", partitions="$4", firsts="$5")


def fence_args(
    group_id: str, cluster_id: str, batch: dict[PartitionKey, list[R]]
) -> tuple[str, str, list[str], list[int], list[int]]:
    """FENCE's values: group, broker cluster, and each partition of the batch with its
    first offset (where a new row starts)."""
    tps = sorted(tp for tp, records in batch.items() if records)
    firsts = [min(r.offset for r in batch[tp]) for tp in tps]
    topics, partitions = columns(tps, 2)
    return group_id, cluster_id, topics, partitions, firsts


async def fence(
    conn: asyncpg.Connection,
    group_id: str,
    cluster_id: str,
    batch: dict[PartitionKey, list[R]],
) -> Fence[R]:
    """Lock every partition's offset row, creating it at the batch's first offset if
    new (one round trip: the no-op update takes the row lock, as ``FOR UPDATE``
    would, and returns the committed value); keep what is new."""
    if not any(batch.values()):
        return Fence({}, Progress())
    rows = await conn.fetch(_FENCE_ALONE, *fence_args(group_id, cluster_id, batch))
    return fenced(batch, {(r["topic"], r["partition"]): r["next_offset"] for r in rows})


def fenced(batch: dict[PartitionKey, list[R]], stored: dict[PartitionKey, int]) -> Fence[R]:
    """What is new in ``batch``, given each partition's stored next offset (read under
    the rows' locks)."""
    fresh_records: dict[PartitionKey, list[R]] = {}
    out = Progress()
    already_applied = 0
    for tp in sorted(tp for tp, records in batch.items() if records):
        records = sorted(batch[tp], key=lambda r: r.offset)
        next_offset = stored[tp]
        first = records[0]
        if next_offset < first.offset:
            if first.read_from is None or first.read_from > next_offset:
                out.seeks[tp] = next_offset  # a gap this consumer has not read: go back
                continue
            out.holes[tp] = (next_offset, first.offset)  # read, and nothing there
        fresh = [r for r in records if r.offset >= next_offset]
        already_applied += len(records) - len(fresh)
        if fresh:
            fresh_records[tp] = fresh
        else:
            out.next_offsets[tp] = next_offset
    return Fence(fresh_records, replace(out, already_applied=already_applied))


def ends(batch: dict[PartitionKey, list[R]]) -> dict[PartitionKey, int]:
    """Each partition's next offset once every record of ``batch`` is applied."""
    return {tp: max(r.offset for r in records) + 1 for tp, records in batch.items() if records}


# The advance with its placeholders named, so a store can run it as a CTE of its own
# write statement (one round trip fewer); :func:`advance_args` gives its values.
ADVANCE = """UPDATE consumer_offsets o SET next_offset = u.n, updated_at = now()
   FROM unnest({topics}::text[], {partitions}::int[], {nexts}::bigint[]) AS u(t, p, n)
   WHERE o.group_id = {group} AND o.cluster_id = {cluster} AND o.topic = u.t
     AND o.partition = u.p"""


_ADVANCE_ALONE = ADVANCE.format(topics="$1", partitions="$2", nexts="$3", group="$4", cluster="$5")


def advance_args(
    group_id: str, cluster_id: str, nexts: dict[PartitionKey, int]
) -> tuple[list[str], list[int], list[int], str, str]:
    """ADVANCE's values: topics, partitions, next offsets, group, broker cluster."""
    topics, partitions = columns(nexts, 2)
    return topics, partitions, list(nexts.values()), group_id, cluster_id


async def advance(
    conn: asyncpg.Connection, group_id: str, cluster_id: str, nexts: dict[PartitionKey, int]
) -> None:
    """Store, in the batch's transaction, each partition's next offset (:func:`ends`)."""
    if nexts:
        await conn.execute(_ADVANCE_ALONE, *advance_args(group_id, cluster_id, nexts))


async def listing(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    """Every stored offset: group, broker cluster, topic, partition, next offset."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT group_id, cluster_id, topic, partition, next_offset, updated_at
           FROM consumer_offsets ORDER BY group_id, cluster_id, topic, partition"""
    )
    return rows


async def forget(
    conn: asyncpg.Connection, group_id: str, cluster_id: str, topic: str, partition: int | None
) -> list[asyncpg.Record]:
    """Delete a group's stored offsets on one broker cluster (one partition or all of a
    topic); returns the rows deleted. The group then starts from Kafka's committed
    offset, else the log's start; the inbox still drops events it has applied."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """DELETE FROM consumer_offsets
           WHERE group_id = $1 AND cluster_id = $2 AND topic = $3
             AND ($4::int IS NULL OR partition = $4)
           RETURNING topic, partition, next_offset""",
        group_id,
        cluster_id,
        topic,
        partition,
    )
    return rows


async def set_offsets(
    conn: asyncpg.Connection, group_id: str, cluster_id: str, topic: str, to: dict[int, int]
) -> None:
    """Set a group's stored offsets (partition → next offset) on one broker cluster, in
    one statement: what ``alma offsets reset`` writes while no member runs."""
    await conn.execute(
        """INSERT INTO consumer_offsets (group_id, cluster_id, topic, partition, next_offset)
           SELECT $1, $2, $3, p, o FROM unnest($4::int[], $5::bigint[]) AS u(p, o)
           ON CONFLICT (group_id, cluster_id, topic, partition)
           DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now()""",
        group_id,
        cluster_id,
        topic,
        list(to),
        list(to.values()),
    )
