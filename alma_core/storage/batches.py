"""What every store that applies polled batches to PostgreSQL shares: the consumed
record, dead letters, outbox rows, stored offsets, the batch transaction and what it
hands the worker afterwards.

Every store (:mod:`~alma_core.storage.checkpoints`, :mod:`~alma_core.storage.joins`,
:mod:`~alma_core.storage.memories`) has one shape, :meth:`BatchStore.in_batch`: one
transaction that fences the offsets (:mod:`alma_core.storage.offsets`), loads what the
batch needs, decides in pure code, writes its effects, dead letters and outbox rows,
and advances the offsets. It returns a :class:`BatchOutcome` (a subclass per store);
the worker's one post-commit step writes the cache, publishes the outbox and
commits to Kafka from the fields every outcome has.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import asyncpg

from alma_core import errors
from alma_core.sequencing import Coordinates
from alma_core.storage import dead_letters, offsets, outbox
from alma_core.storage.cache import CacheEntry
from alma_core.storage.dead_letters import storable
from alma_core.storage.offsets import PartitionKey
from alma_core.storage.outbox import OutboxRow
from alma_core.storage.postgres import is_storage_failure, storage_error
from schemas.decoder import Decoded, Rejection

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

    @property
    def coords(self) -> Coordinates:
        return Coordinates(self.topic, self.partition, self.offset)


@dataclass(frozen=True)
class DeadLetter:
    record: Incoming
    reason: str
    detail: str
    event_id: str | None
    run_id: str | None
    tenant_id: str | None


def dead_letter_for(record: Incoming, exc: errors.AlmaError | Rejection) -> DeadLetter:
    if isinstance(exc, Rejection):
        return DeadLetter(
            record, exc.reason.value, exc.describe(), exc.event_id, exc.run_id, exc.tenant_id
        )
    event = record.decoded
    assert not isinstance(event, Rejection)
    return DeadLetter(
        record, exc.reason, exc.message, event.event_id, event.run_id, event.tenant_id
    )


def headers_json(pairs: dict[str, str | int | None]) -> str:
    return json.dumps([[k, storable(str(v))] for k, v in pairs.items() if v is not None])


async def record_dead_letter(
    conn: asyncpg.Connection, consumer: str, cluster_id: str, dlq_topic: str, dl: DeadLetter
) -> OutboxRow:
    """Keep the dead letter (for `alma dlq`) and return its dead-letter-topic record."""
    await dead_letters.insert(conn, consumer, cluster_id, dl)
    return dead_letter_record(consumer, dlq_topic, dl)


def dead_letter_headers(consumer: str, dl: DeadLetter) -> dict[str, str | int | None]:
    """What a dead-letter record says in its headers: the reason and where it came from."""
    rec = dl.record
    return {
        "alma.reason": dl.reason,
        "alma.detail": storable(dl.detail, 1000),
        "alma.consumer": consumer,
        "alma.source.topic": rec.topic,
        "alma.source.partition": rec.partition,
        "alma.source.offset": rec.offset,
    }


def dead_letter_record(consumer: str, dlq_topic: str, dl: DeadLetter) -> OutboxRow:
    """The dead-letter topic's record: the original key and value, the reason in headers."""
    rec = dl.record
    return (dlq_topic, rec.key, rec.value or b"", headers_json(dead_letter_headers(consumer, dl)))


@dataclass
class BatchOutcome:
    """What every store's batch transaction hands the post-commit step."""

    next_offsets: dict[PartitionKey, int] = field(default_factory=dict)
    seeks: dict[PartitionKey, int] = field(default_factory=dict)
    already_applied: int = 0  # records at offsets this group had applied before
    holes: dict[PartitionKey, tuple[int, int]] = field(default_factory=dict)  # no records
    dead_letters: list[DeadLetter] = field(default_factory=list)
    outbox_ids: list[int] = field(default_factory=list)
    cache_writes: list[CacheEntry] = field(default_factory=list)
    # (tenant, run id) of runs whose checkpoints are gone
    cache_forgets: list[tuple[str, str]] = field(default_factory=list)
    # the store's own write advanced the offsets (offsets.ADVANCE in its statement)
    advanced: bool = False


OutcomeT = TypeVar("OutcomeT", bound=BatchOutcome)
# A store's own work inside the batch transaction: the records that are new, the outcome
# to fill in; returns the outbox rows it wants published after commit.
Work = Callable[[asyncpg.Connection, Batch, OutcomeT], Awaitable[list[OutboxRow]]]


class BatchStore:
    """Base of the stores: the pool, the group's stored offsets, the batch transaction."""

    def __init__(self, pool: asyncpg.Pool, group_id: str, *, consumer: str, dlq_topic: str) -> None:
        self.pool = pool
        self.group_id = group_id
        self.consumer = consumer  # the name dead letters carry
        self.dlq_topic = dlq_topic

    async def stored_offsets(
        self, cluster_id: str, partitions: list[PartitionKey]
    ) -> dict[PartitionKey, int]:
        """Where each partition resumes, for this group on this broker cluster."""
        return await self._guarded(
            "reading stored offsets",
            offsets.stored_offsets(self.pool, self.group_id, cluster_id, partitions),
        )

    async def in_batch(
        self, doing: str, cluster_id: str, batch: Batch, outcome: OutcomeT, work: Work[OutcomeT]
    ) -> OutcomeT:
        """The one shape of every store's batch: in one transaction, fence the offsets,
        let ``work`` apply the new records, store the dead letters, write the outbox
        and advance the offsets."""

        async def run(conn: asyncpg.Connection) -> OutcomeT:
            fenced = await offsets.fence(conn, self.group_id, cluster_id, batch)
            outcome.seeks, outcome.next_offsets = fenced.seeks, fenced.next_offsets
            outcome.already_applied = fenced.already_applied
            outcome.holes = fenced.holes
            if not fenced.todo:
                return outcome
            rows = await work(conn, fenced.todo, outcome)
            for dl in outcome.dead_letters:
                rows.append(
                    await record_dead_letter(conn, self.consumer, cluster_id, self.dlq_topic, dl)
                )
            outcome.outbox_ids = await outbox.insert(conn, rows)
            nexts = offsets.ends(fenced.todo)
            if not outcome.advanced:
                await offsets.advance(conn, self.group_id, cluster_id, nexts)
            outcome.next_offsets.update(nexts)
            return outcome

        return await self.in_transaction(doing, run)

    async def in_transaction(
        self, doing: str, work: Callable[[asyncpg.Connection], Awaitable[T]]
    ) -> T:
        async def run() -> T:
            async with self.pool.acquire() as conn, conn.transaction():
                return await work(conn)

        return await self._guarded(doing, run())

    async def skip(self, cluster_id: str, batch: Batch) -> tuple[BatchOutcome, bool]:
        """The last resort: store that these records are done without any effect (their
        dead-letter row could not be written). Fenced like every batch, so a zombie
        member cannot skip what the partition's owner has not seen. Also returns
        whether there was anything left to skip (False: a redelivery)."""
        skipped: list[Incoming] = []

        async def work(conn: asyncpg.Connection, todo: Batch, _: BatchOutcome) -> list[OutboxRow]:
            skipped.extend(r for records in todo.values() for r in records)
            return []

        outcome = await self.in_batch(
            "skipping an unstorable record", cluster_id, batch, BatchOutcome(), work
        )
        return outcome, bool(skipped)

    @staticmethod
    async def _guarded(doing: str, work: Awaitable[T]) -> T:
        try:
            return await work
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, doing) from exc
            raise
