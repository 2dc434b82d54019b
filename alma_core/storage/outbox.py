"""The ``outbox`` table: records written in a batch's transaction, published after commit.

A row is written with the effects it announces (:func:`insert`, inside the batch's
transaction), published by the worker's relay (:mod:`consumers.outbox`) and marked;
a row Kafka refused keeps its place with ``attempts``, ``last_error`` and a
``next_attempt_at`` that doubles; rows published long ago are pruned.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

OutboxRow = tuple[str, bytes | None, bytes, str]  # topic, key, value, headers (JSON pairs)

_COLUMNS = "id, topic, key, value, headers"


async def insert(conn: asyncpg.Connection, rows: list[OutboxRow]) -> list[int]:
    """Write rows in the caller's transaction; their ids, in order."""
    if not rows:
        return []
    inserted = await conn.fetch(
        """INSERT INTO outbox (topic, key, value, headers)
           SELECT * FROM unnest($1::text[], $2::bytea[], $3::bytea[], $4::jsonb[])
           RETURNING id""",
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
    )
    return [r["id"] for r in inserted]


async def unpublished(pool: asyncpg.Pool, ids: list[int]) -> list[asyncpg.Record]:
    """These rows, those not yet published, in id order."""
    rows: list[asyncpg.Record] = await pool.fetch(
        f"""SELECT {_COLUMNS} FROM outbox
            WHERE id = ANY($1::bigint[]) AND published_at IS NULL ORDER BY id""",
        ids,
    )
    return rows


async def left_behind(pool: asyncpg.Pool, older_than_s: float, limit: int = 1000) -> list[Any]:
    """Rows not published ``older_than_s`` after they were written (a crash between
    commit and publish, or a refused send) whose next attempt is due."""
    rows: list[asyncpg.Record] = await pool.fetch(
        f"""SELECT {_COLUMNS} FROM outbox
            WHERE published_at IS NULL AND created_at < now() - make_interval(secs => $1)
              AND (next_attempt_at IS NULL OR next_attempt_at <= now())
            ORDER BY id LIMIT $2""",
        older_than_s,
        limit,
    )
    return rows


async def mark_published(pool: asyncpg.Pool, ids: list[int]) -> None:
    if ids:
        await pool.execute(
            "UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[])", ids
        )


async def mark_failed(
    pool: asyncpg.Pool, failures: list[tuple[int, str]], retry_max_s: float
) -> None:
    """Count a refused attempt of each row and put its next one off (doubling, at most
    ``retry_max_s``)."""
    if failures:
        await pool.execute(
            """UPDATE outbox o SET attempts = o.attempts + 1, last_error = u.error,
                   next_attempt_at = now() + make_interval(
                       secs => least($3::float8, power(2, o.attempts + 1)))
               FROM unnest($1::bigint[], $2::text[]) AS u(id, error)
               WHERE o.id = u.id""",
            [i for i, _ in failures],
            [e[:1000] for _, e in failures],
            retry_max_s,
        )


async def prune(pool: asyncpg.Pool) -> None:
    """Forget rows published more than an hour ago."""
    await pool.execute("DELETE FROM outbox WHERE published_at < now() - interval '1 hour'")


def header_pairs(headers: object) -> list[tuple[str, str]]:
    """A row's headers (stored as JSON pairs) as Kafka header pairs."""
    data: Any = json.loads(headers) if isinstance(headers, str) else headers
    return [(str(k), str(v)) for k, v in (data or [])]
