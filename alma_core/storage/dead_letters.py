"""The ``dead_letters`` table: every record a consumer could not apply, its bytes exactly
as they came (bytea) and its reason, for ``alma dlq`` and the SDK's ``applied()``.

Rows are written in the batch's transaction (:func:`insert`), beside the record sent
to the dead-letter topic; text columns hold only what PostgreSQL accepts (``storable``:
a hostile record's NUL or lone surrogate is escaped, never the reason a row fails).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg

from alma_core import errors
from alma_core.schemas.decoder import Decoded, Rejection
from alma_core.storage.outbox import OutboxRow


class Source(Protocol):
    """The consumed record a dead letter keeps (a batch's ``Incoming``)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def decoded(self) -> Decoded: ...


def storable(text: str | None, limit: int | None = None) -> str | None:
    """``text`` as PostgreSQL's text and jsonb can hold it: a NUL becomes ``\\x00`` and a
    lone surrogate its ``\\udXXX`` escape. Used for whatever a hostile record may put in
    a dead letter's columns and headers (its bytes are kept exactly, as bytea)."""
    if text is None:
        return None
    clean = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return clean[:limit] if limit is not None else clean


@dataclass(frozen=True)
class DeadLetter:
    record: Source
    reason: str
    detail: str
    event_id: str | None
    run_id: str | None
    tenant_id: str | None


def dead_letter_for(record: Source, exc: errors.AlmaError | Rejection) -> DeadLetter:
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


async def insert(conn: asyncpg.Connection, consumer: str, cluster_id: str, dl: DeadLetter) -> None:
    """Keep a dead letter (in the caller's transaction); once per source record: its
    broker cluster, topic, partition and offset."""
    rec = dl.record
    await conn.execute(
        """INSERT INTO dead_letters (consumer, reason, detail, event_id, run_id, tenant_id,
               source_topic, source_partition, source_offset, key, value, cluster_id)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
           ON CONFLICT DO NOTHING""",
        consumer,
        dl.reason,
        storable(dl.detail),
        storable(dl.event_id),
        storable(dl.run_id),
        storable(dl.tenant_id),
        rec.topic,
        rec.partition,
        rec.offset,
        rec.key,
        rec.value,
        cluster_id,
    )


async def listing(
    conn: asyncpg.Connection, *, reason: str | None, tenant_id: str | None, limit: int
) -> list[dict[str, Any]]:
    """Dead letters, newest first (without their bytes)."""
    rows = await conn.fetch(
        """SELECT id, consumer, reason, detail, event_id, run_id, tenant_id, source_topic,
                  source_partition, source_offset, cluster_id, created_at, replayed_at
           FROM dead_letters
           WHERE ($1::text IS NULL OR reason = $1) AND ($2::text IS NULL OR tenant_id = $2)
           ORDER BY id DESC LIMIT $3""",
        reason,
        tenant_id,
        limit,
    )
    return [dict(r) for r in rows]


async def of_run(conn: asyncpg.Connection, run_id: str, tenant_id: str) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT id, reason, detail, event_id, created_at FROM dead_letters
           WHERE run_id = $1 AND tenant_id = $2 ORDER BY id""",
        run_id,
        tenant_id,
    )
    return rows


async def original(
    conn: asyncpg.Connection,
    letter_id: int,
    tenant_id: str | None = None,
    *,
    for_update: bool = False,
) -> asyncpg.Record | None:
    """A dead letter's key and value as they came, its tenant (the topic's, with
    ALMA_TENANT_TOPICS), and when it was last replayed; with
    ``tenant_id``, only a letter of that tenant. ``for_update`` (in a transaction): the
    row locked until it ends, so two replays of one letter go one after the other."""
    lock = " FOR UPDATE" if for_update else ""
    row: asyncpg.Record | None = await conn.fetchrow(
        f"""SELECT key, value, tenant_id, replayed_at FROM dead_letters
            WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2){lock}""",
        letter_id,
        tenant_id,
    )
    return row


async def run_standing(
    conn: asyncpg.Connection, tenant_id: str, run_id: str
) -> asyncpg.Record | None:
    """A run's status, end and last seq as they stand (None: no such run yet): what a
    replayed event would meet."""
    row: asyncpg.Record | None = await conn.fetchrow(
        "SELECT status, completed_at, last_seq FROM runs WHERE tenant_id = $1 AND run_id = $2",
        tenant_id,
        run_id,
    )
    return row


async def waiting_of_run(conn: asyncpg.Connection, tenant_id: str, run_id: str) -> list[int]:
    """The run's letters not replayed yet, oldest first."""
    rows = await conn.fetch(
        """SELECT id FROM dead_letters
           WHERE tenant_id = $1 AND run_id = $2 AND replayed_at IS NULL ORDER BY id""",
        tenant_id,
        run_id,
    )
    return [int(r["id"]) for r in rows]


async def older_of_run(
    conn: asyncpg.Connection, letter_id: int, tenant_id: str, run_id: str, reason: str
) -> int | None:
    """The run's oldest letter of ``reason`` older than ``letter_id`` and not replayed."""
    older: int | None = await conn.fetchval(
        """SELECT min(id) FROM dead_letters
           WHERE tenant_id = $1 AND run_id = $2 AND id < $3 AND replayed_at IS NULL
             AND reason = $4""",
        tenant_id,
        run_id,
        letter_id,
        reason,
    )
    return older


async def with_records(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    tenant_id: str,
    reason: str | None,
    limit: int,
    head_bytes: int,
    before: int | None = None,
    letter: int | None = None,
) -> tuple[list[asyncpg.Record], dict[str, int]]:
    """The tenant's dead letters newest first (``reason``'s, when given; those older
    than the letter ``before``, a page's last; the one ``letter``), each with the first
    ``head_bytes`` of its key and value and their full sizes; and how many the tenant
    has of each reason."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT id, consumer, reason, detail, event_id, run_id, source_topic,
                  source_partition, source_offset, created_at, replayed_at,
                  substring(key FROM 1 FOR $4) AS key_head, octet_length(key) AS key_bytes,
                  substring(value FROM 1 FOR $4) AS value_head,
                  octet_length(value) AS value_bytes
           FROM dead_letters WHERE tenant_id = $1 AND ($2::text IS NULL OR reason = $2)
             AND ($5::bigint IS NULL OR id < $5) AND ($6::bigint IS NULL OR id = $6)
           ORDER BY id DESC LIMIT $3""",
        tenant_id,
        reason,
        limit,
        head_bytes,
        before,
        letter,
    )
    reasons = {
        r["reason"]: int(r["n"])
        for r in await conn.fetch(
            """SELECT reason, count(*) AS n FROM dead_letters WHERE tenant_id = $1
               GROUP BY reason ORDER BY reason""",
            tenant_id,
        )
    }
    return rows, reasons


async def mark_replayed(conn: asyncpg.Connection, letter_id: int) -> None:
    await conn.execute("UPDATE dead_letters SET replayed_at = now() WHERE id = $1", letter_id)
