"""The ``outbox`` table: records written in a batch's transaction, published after commit.

A row is written with the effects it announces (:func:`insert`, inside the batch's
transaction), claimed by one relay (:func:`claim`, :func:`claim_left_behind`),
published by it (:mod:`alma_core.consumers.outbox`) and marked; a row Kafka refused keeps its
place with ``attempts``, ``last_error`` and a ``next_attempt_at`` that doubles; rows
published long ago are pruned.

**Order.** The rows of one topic and key (a run's hand-offs to the joiner and learner,
a run's replies) are published in the order they were written: a row is claimed only
with every earlier unpublished row of its topic and key, and a relay sends them one
after the other, stopping at the first Kafka refuses. The joiner depends on it (a run's
joins are merged in partition order). Rows of *unordered* topics (dead letters: each a
record complete in itself) go on their own, so one that can never be sent holds back
nothing.

**Claims.** A claim is ``claimed_until``: other relays skip the row until then, or until
the claimer marks it. The sweep takes rows with ``FOR UPDATE SKIP LOCKED`` on the first
unpublished row of each topic and key, so two relays never hold parts of one run's rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import asyncpg

from alma_core.schemas import jsoncodec
from alma_core.schemas.events import BranchJoin
from alma_core.tenancy import tenant_topic

OutboxRow = tuple[str, bytes | None, bytes, str]  # topic, key, value, headers (JSON pairs)


def join_reply(
    event: BranchJoin,
    reply: dict[str, Any],
    default_topic: str,
    trace: dict[str, str] | None = None,
    *,
    per_tenant: bool = False,
) -> OutboxRow:
    """The row that answers a join on its reply topic (the join's ``reply_to``, else
    ``default_topic``, or with ``per_tenant`` (ALMA_TENANT_TOPICS) that topic's one for
    the join's tenant): canonical JSON, so an answer sent again is byte for byte the
    first. ``trace``: the join record's trace context headers, so the reply carries it
    back."""
    headers = [["alma.join_id", event.payload.join_id], *(trace or {}).items()]
    if per_tenant:
        default_topic = tenant_topic(default_topic, event.tenant_id)
    return (
        event.payload.reply_to or default_topic,
        event.run_id.encode(),
        jsoncodec.canonical(reply),
        json.dumps(headers),
    )


_COLUMNS = "o.id, o.topic, o.key, o.value, o.headers"


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


async def claim(
    pool: asyncpg.Pool, ids: list[int], unordered: Sequence[str], lease_s: float
) -> list[asyncpg.Record]:
    """Claim these rows (just written by a batch), for ``lease_s``: those not published,
    not claimed by another relay and, in an ordered topic, not behind an earlier
    unpublished row of their key outside ``ids`` (that row's relay or retry comes
    first; the sweep takes them after it). In id order."""
    rows: list[asyncpg.Record] = await pool.fetch(
        f"""UPDATE outbox o SET claimed_until = now() + make_interval(secs => $3)
            WHERE o.id = ANY($1::bigint[]) AND o.published_at IS NULL
              AND (o.claimed_until IS NULL OR o.claimed_until < now())
              AND (o.topic = ANY($2::text[]) OR NOT EXISTS (
                   SELECT 1 FROM outbox e
                   WHERE e.published_at IS NULL AND e.topic = o.topic
                     AND e.key IS NOT DISTINCT FROM o.key AND e.id < o.id
                     AND e.id <> ALL($1::bigint[])))
            RETURNING {_COLUMNS}""",
        ids,
        list(unordered),
        lease_s,
    )
    return sorted(rows, key=lambda r: r["id"])


async def claim_left_behind(
    pool: asyncpg.Pool,
    older_than_s: float,
    unordered: Sequence[str],
    lease_s: float,
    limit: int = 1000,
) -> list[asyncpg.Record]:
    """Claim rows left behind (a crash between commit and publish, a refused send) whose
    next attempt is due, ``older_than_s`` after they were written: in an ordered topic,
    the first unpublished row of each key with every later one of that key; a row of
    an unordered topic alone. In id order."""
    rows: list[asyncpg.Record] = await pool.fetch(
        f"""WITH heads AS (
                SELECT DISTINCT ON (topic, key) id FROM outbox
                WHERE published_at IS NULL AND topic <> ALL($2::text[])
                ORDER BY topic, key, id
            ), due AS (
                SELECT o.id, o.topic, o.key, o.topic = ANY($2::text[]) AS alone
                FROM outbox o
                WHERE o.published_at IS NULL
                  AND o.created_at < now() - make_interval(secs => $1)
                  AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
                  AND (o.claimed_until IS NULL OR o.claimed_until < now())
                  AND (o.topic = ANY($2::text[]) OR o.id IN (SELECT id FROM heads))
                ORDER BY o.id LIMIT $4
                FOR UPDATE OF o SKIP LOCKED
            )
            UPDATE outbox o SET claimed_until = now() + make_interval(secs => $3)
            FROM due d
            WHERE o.published_at IS NULL
              AND (o.claimed_until IS NULL OR o.claimed_until < now())
              AND (o.id = d.id OR (NOT d.alone AND o.topic = d.topic
                                   AND o.key IS NOT DISTINCT FROM d.key))
            RETURNING {_COLUMNS}""",
        older_than_s,
        list(unordered),
        lease_s,
        limit,
    )
    return sorted(rows, key=lambda r: r["id"])


async def mark_published(pool: asyncpg.Pool, ids: list[int]) -> None:
    if ids:
        await pool.execute(
            """UPDATE outbox SET published_at = now(), claimed_until = NULL
               WHERE id = ANY($1::bigint[])""",
            ids,
        )


async def release(pool: asyncpg.Pool, ids: list[int]) -> None:
    """Give up the claim on rows not sent (behind a refused row of their key)."""
    if ids:
        await pool.execute(
            "UPDATE outbox SET claimed_until = NULL WHERE id = ANY($1::bigint[])", ids
        )


async def mark_failed(
    pool: asyncpg.Pool, failures: list[tuple[int, str]], retry_max_s: float
) -> None:
    """Count a refused attempt of each row and put its next one off (doubling, at most
    ``retry_max_s``)."""
    if failures:
        await pool.execute(
            """UPDATE outbox o SET attempts = o.attempts + 1, last_error = u.error,
                   claimed_until = NULL, next_attempt_at = now() + make_interval(
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
