"""What every store that applies polled batches to PostgreSQL shares: the consumed
record, dead letters, outbox rows, and the one shape of a batch's transaction.

Every store (:mod:`~alma_core.storage.checkpoints`, :mod:`~alma_core.storage.joins`,
:mod:`~alma_core.storage.memories`) is a :class:`BatchStore` and writes only its own
effects (:meth:`BatchStore.write`). :meth:`BatchStore.transact` is the transaction around
it, top to bottom: fence the offsets (:mod:`alma_core.storage.offsets`), let the store
write what the new records make (returned as its :class:`Effects`), store the dead
letters and the outbox rows, advance the offsets. It returns a :class:`Committed`: the
batch's :class:`~alma_core.storage.offsets.Progress` and the store's effects, from which
the worker's one post-commit step writes the cache, publishes the outbox and commits to
Kafka.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import asyncpg

from alma_core import tracing
from alma_core.schemas.decoder import Decoded
from alma_core.sequencing import Coordinates
from alma_core.storage import dead_letters, offsets, outbox
from alma_core.storage.cache_entries import CacheEntry
from alma_core.storage.dead_letters import DeadLetter, dead_letter_record
from alma_core.storage.offsets import PartitionKey, Progress
from alma_core.storage.outbox import OutboxRow
from alma_core.storage.postgres import is_storage_failure, storage_error

T = TypeVar("T")
Batch = dict[PartitionKey, list["Incoming"]]

# On a hand-off: the run's latest seq at the event's place in its partition. A join is
# merged from the heads as they stood there and takes the next seq.
RUN_SEQ_HEADER = "alma.run.seq"


@dataclass(frozen=True)
class Incoming:
    """One consumed record with its decoding."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    decoded: Decoded
    headers: tuple[tuple[str, bytes], ...] = ()
    # The consumer's position when it read this record: its own offset, or an earlier
    # one when the log holds no record in between (a commit marker, a removed record).
    read_from: int | None = None

    def header_int(self, name: str) -> int | None:
        """A header holding a decimal integer, or None (absent or unreadable)."""
        for key, value in self.headers:
            if key == name:
                try:
                    return int(value.decode("ascii"))
                except (UnicodeDecodeError, ValueError):
                    return None
        return None

    def trace_headers(self) -> dict[str, str]:
        """The record's W3C trace context headers, to copy onto the records it leads to
        (hand-offs, replies); in a traced worker, the context of the record's own span."""
        if not self.headers:
            return {}
        return tracing.context_pairs(self.headers)

    @property
    def coords(self) -> Coordinates:
        return Coordinates(self.topic, self.partition, self.offset)


@dataclass
class Effects:
    """What a store's write made of a batch's new records, for the post-commit step.
    A store returns its own subclass (what its metrics count)."""

    dead_letters: list[DeadLetter] = field(default_factory=list)
    outbox: list[OutboxRow] = field(default_factory=list)  # hand-offs, replies
    cache_writes: list[CacheEntry] = field(default_factory=list)
    # (tenant, run id) of runs whose checkpoints are gone
    cache_forgets: list[tuple[str, str]] = field(default_factory=list)
    # the write advanced the offsets itself (offsets.ADVANCE in its statement)
    offsets_stored: bool = False

    # the outcome of a new event span_attributes does not list (the checkpointer's
    # duplicates); None: the event is not this store's (completions on the joiner's topic)
    unlisted_outcome: ClassVar[str | None] = None

    def span_attributes(self) -> dict[str, dict[str, Any]]:
        """What each new event came to, by event id, for its span (a traced worker asks;
        never state contents). A store adds its own to the dead letters' reasons."""
        return {
            dl.event_id: {"alma.outcome": "dead_letter", "alma.dead_letter.reason": dl.reason}
            for dl in self.dead_letters
            if dl.event_id
        }


EffectsT = TypeVar("EffectsT", bound=Effects)
PreparedT = TypeVar("PreparedT")
ReadsT = TypeVar("ReadsT")


@dataclass(frozen=True)
class Committed(Generic[EffectsT]):
    """A committed batch: where it leaves each partition, what its new records made
    (None: there were none), and the outbox rows it wrote, to publish now."""

    progress: Progress
    effects: EffectsT | None = None
    outbox_ids: list[int] = field(default_factory=list)


async def guarded(doing: str, work: Awaitable[T]) -> T:
    """``work``, its PostgreSQL failures as our :class:`errors.StorageError`."""
    try:
        return await work
    except Exception as exc:
        if is_storage_failure(exc):
            raise storage_error(exc, doing) from exc
        raise


class BatchStore(Generic[PreparedT, EffectsT, ReadsT]):
    """Base of the stores: the pool, the group's stored offsets, the batch transaction.
    ``PreparedT``: what the worker prepared for a batch before the transaction (the
    learner's drafts and vectors; None for the others). ``ReadsT``: what a store reads
    in the fence's round trip (:meth:`open`; None for those that read after it)."""

    doing = "applying a batch"  # what a failure message says the store was doing

    def __init__(self, pool: asyncpg.Pool, group_id: str, *, consumer: str, dlq_topic: str) -> None:
        self.pool = pool
        self.group_id = group_id
        self.consumer = consumer  # the name dead letters carry
        self.dlq_topic = dlq_topic

    async def stored_offsets(
        self, cluster_id: str, partitions: list[PartitionKey]
    ) -> dict[PartitionKey, int]:
        """Where each partition resumes, for this group on this broker cluster."""
        return await guarded(
            "reading stored offsets",
            offsets.stored_offsets(self.pool, self.group_id, cluster_id, partitions),
        )

    async def transact(
        self, cluster_id: str, batch: Batch, prepared: PreparedT
    ) -> Committed[EffectsT]:
        """The one shape of every store's batch, in one transaction: fence the offsets,
        write what the new records make, store their dead letters and outbox rows,
        advance the offsets."""
        async with self.transaction(self.doing) as conn:
            fence, reads = await self.open(conn, cluster_id, batch)
            if not fence.fresh:
                return Committed(fence.progress)
            effects = await self.write(conn, cluster_id, fence.fresh, prepared, reads)
            ids = await self.store_extras(conn, cluster_id, effects)
            if not effects.offsets_stored:
                await offsets.advance(conn, self.group_id, cluster_id, offsets.ends(fence.fresh))
        return Committed(fence.progress_after(), effects, ids)

    async def store_extras(
        self, conn: asyncpg.Connection, cluster_id: str, effects: EffectsT
    ) -> list[int]:
        """In the batch's transaction: its dead letters and its outbox rows (hand-offs,
        replies, the dead letters' records); the outbox rows' ids, to publish."""
        rows = list(effects.outbox)
        for dl in effects.dead_letters:
            await dead_letters.insert(conn, self.consumer, cluster_id, dl)
            rows.append(dead_letter_record(self.consumer, self.dlq_topic, dl))
        return await outbox.insert(conn, rows)

    async def open(
        self, conn: asyncpg.Connection, cluster_id: str, batch: Batch
    ) -> tuple[offsets.Fence[Incoming], ReadsT | None]:
        """The batch transaction's first statement: the fence, and whatever the store
        reads in the same round trip (None: nothing)."""
        return await offsets.fence(conn, self.group_id, cluster_id, batch), None

    async def write(
        self,
        conn: asyncpg.Connection,
        cluster_id: str,
        fresh: Batch,
        prepared: PreparedT,
        reads: ReadsT | None,
    ) -> EffectsT:
        """The store's own effects of the records in ``fresh`` (none applied before), in
        the batch's transaction; ``reads``: what :meth:`open` read."""
        raise NotImplementedError

    async def assigned(self, partitions: list[PartitionKey]) -> None:
        """Partitions newly assigned to this member (what a store keeps of them in
        memory may be stale)."""

    async def skip(self, cluster_id: str, batch: Batch) -> tuple[Progress, bool]:
        """The last resort: store that these records are done without any effect (their
        dead-letter row could not be written). Fenced like every batch, so a zombie
        member cannot skip what the partition's owner has not seen. Also returns
        whether there was anything left to skip (False: a redelivery)."""
        async with self.transaction("skipping an unstorable record") as conn:
            fence = await offsets.fence(conn, self.group_id, cluster_id, batch)
            await offsets.advance(conn, self.group_id, cluster_id, offsets.ends(fence.fresh))
        return fence.progress_after(), bool(fence.fresh)

    @contextlib.asynccontextmanager
    async def transaction(self, doing: str) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection in a transaction; PostgreSQL's failures (not those of code
        run inside it: :func:`~alma_core.storage.postgres.is_storage_failure`) come out
        as our :class:`errors.StorageError`."""
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                yield conn
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, doing) from exc
            raise
