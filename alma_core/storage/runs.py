"""Reads of ``runs`` and their audit trail (``run_events``): what operators list and
show, and what became of one event (the SDK's read-your-writes).

The checkpointer writes these tables (:mod:`alma_core.storage.checkpoints`); every
read here is scoped by tenant when a tenant is given (docs/guarantees.md §6).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, TypeAlias

import asyncpg

from alma_core import errors
from alma_core.sequencing import BLOCKED, REFUSED, RUN_STATUSES
from alma_core.storage import dead_letters

Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool


@dataclass(frozen=True)
class EventEffect:
    """What the checkpointer did with one event (``effect`` and its checkpoint seq), or
    why it was dead-lettered (``rejected``: the reason and the detail)."""

    effect: str | None = None
    checkpoint_seq: int | None = None
    rejected: tuple[str, str] | None = None


# What became of one event of a run, in one round trip: its effect when recorded, else
# its latest dead letter (an event dead-lettered, then replayed and applied, is applied).
_EFFECT_OF = """
SELECT e.effect, e.checkpoint_seq, e.event_id IS NOT NULL AS recorded, d.reason, d.detail
FROM (SELECT 1) AS one
LEFT JOIN run_events e ON e.tenant_id = $2 AND e.event_id = $1 AND e.run_id = $3
LEFT JOIN LATERAL (
    SELECT reason, detail FROM dead_letters
    WHERE e.event_id IS NULL AND event_id = $1 AND tenant_id = $2 AND run_id = $3
    ORDER BY id DESC LIMIT 1
) AS d ON true
"""


async def effect_of(conn: Conn, event_id: str, tenant_id: str, run_id: str) -> EventEffect | None:
    """The event's effect in this run, its rejection, or None while it has had neither
    (an event of another run with the same id is not this one's)."""
    row = await conn.fetchrow(_EFFECT_OF, event_id, tenant_id, run_id)
    assert row is not None  # one row, always
    if row["recorded"]:
        return EventEffect(row["effect"], row["checkpoint_seq"])
    if row["reason"] is not None:
        return EventEffect(rejected=(row["reason"], row["detail"]))
    return None


async def owner(conn: Conn, tenant_id: str, run_id: str) -> str | None:
    """The workflow the run belongs to; None for a run not seen yet, or a LangGraph
    thread deleted by its graph (its id is free)."""
    found: str | None = await conn.fetchval(
        """SELECT workflow_id FROM runs
           WHERE tenant_id = $1 AND run_id = $2 AND released_at IS NULL""",
        tenant_id,
        run_id,
    )
    return found


async def unrecorded(conn: Conn, tenant_id: str, run_id: str, event_ids: list[str]) -> list[str]:
    """Those of the run's ``event_ids`` the checkpointer has not recorded (yet, or ever:
    dead-lettered), in the order given."""
    rows = await conn.fetch(
        """SELECT event_id FROM run_events
           WHERE tenant_id = $1 AND run_id = $2 AND event_id = ANY($3::text[])""",
        tenant_id,
        run_id,
        event_ids,
    )
    recorded = {r["event_id"] for r in rows}
    return [e for e in event_ids if e not in recorded]


# A run is blocked (docs/guarantees.md §11) while it is running and one of its events
# was dead-lettered since the run last advanced, that letter neither replayed nor its
# event applied since: the run waits on an operator. It stops being blocked when the
# letter is replayed (a replay dead-lettered again is a new letter), when the event is
# applied (a join handed to the joiner is recorded, not applied: the joiner may still
# refuse it, a branch it names never having come), when the run advances anyway (a
# later event or a merge applied) or ends. A
# producer's refusal (tenant_not_producer, reply_to_refused) names a run its producer
# may not write to, so it blocks nothing. One statement, read from the letters' side
# (few) and joined to the runs, so that a listing hashes it once instead of probing the
# letters for every running run; ``{tenant}``: the SQL of the tenant (NULL: all).
NOT_BLOCKING: Final = ("tenant_not_producer", "reply_to_refused")
_BLOCKING_LETTERS = f"""
SELECT d.tenant_id, d.run_id, d.id, d.reason, d.detail, d.event_id, d.created_at
FROM dead_letters d
JOIN runs br ON br.tenant_id = d.tenant_id AND br.run_id = d.run_id
WHERE ({{tenant}}::text IS NULL OR d.tenant_id = {{tenant}}) AND d.replayed_at IS NULL
  AND d.reason NOT IN ({", ".join(f"'{r}'" for r in NOT_BLOCKING)})
  AND br.status = 'running' AND d.created_at >= br.updated_at
  AND NOT EXISTS (SELECT 1 FROM run_events be WHERE be.tenant_id = d.tenant_id
                  AND be.run_id = d.run_id AND be.event_id = d.event_id
                  AND be.effect IS DISTINCT FROM 'handed_off')"""


def blocked_runs(tenant: str) -> str:
    """A subquery of the (tenant_id, run_id) of every blocked run of the tenant the
    SQL ``tenant`` names (a parameter such as ``$1``; NULL: every tenant's), for
    ``(tenant_id, run_id) IN (...)``."""
    return f"SELECT tenant_id, run_id FROM ({_BLOCKING_LETTERS.format(tenant=tenant)}) b"


def shown_status(tenant: str) -> str:
    """A run's status as shown (``blocked`` for a running run that is), from the columns
    of the ``runs`` row at hand, for a select list."""
    return (
        f"CASE WHEN status = 'running' AND (tenant_id, run_id) IN "
        f"({blocked_runs(tenant)}) THEN '{BLOCKED}' ELSE status END"
    )


async def blocking_letters(conn: Conn, tenant_id: str, run_id: str) -> list[asyncpg.Record]:
    """The dead letters that block the run, oldest first (none: it is not blocked)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        _BLOCKING_LETTERS.format(tenant="$1") + " AND d.run_id = $2 ORDER BY d.id",
        tenant_id,
        run_id,
    )
    return rows


async def blocked_counts(conn: Conn) -> dict[str, int]:
    """How many blocked runs each tenant has (only tenants with some)."""
    rows = await conn.fetch(
        f"""SELECT tenant_id, count(DISTINCT run_id) AS n
            FROM ({_BLOCKING_LETTERS.format(tenant="$1")}) b GROUP BY tenant_id""",
        None,
    )
    return {r["tenant_id"]: int(r["n"]) for r in rows}


# The runs a listing picks, latest activity first. Of all of one tenant's runs: the
# newest of each status from its index (tenant, status, updated_at), merged; a single
# ORDER BY over them would sort every run the tenant has (a sequential scan: 232 ms at
# a million runs). Otherwise one query: of one status, from the same index; of one
# workflow, from its (tenant, workflow) index; across tenants (an operator's
# own listing), a scan of every run.
_NEWEST_OF_EACH_STATUS = (
    "SELECT * FROM ("
    + " UNION ALL ".join(
        f"""(SELECT * FROM runs
             WHERE tenant_id = $1 AND status = '{status}'
             ORDER BY updated_at DESC LIMIT $4)"""
        for status in RUN_STATUSES
    )
    # $2, the workflow, is NULL on this path; named so that every parameter has a type
    + ") picked WHERE $2::text IS NULL ORDER BY updated_at DESC LIMIT $4"
)
_NEWEST = """SELECT * FROM runs
             WHERE ($1::text IS NULL OR tenant_id = $1)
               AND ($2::text IS NULL OR workflow_id = $2)
               AND ($3::text IS NULL OR status = $3
                    OR ($3 = 'deleted' AND status = 'running')
                    OR ($3 = '{blocked}' AND status = 'running'
                        AND (tenant_id, run_id) IN ({blocked_runs})))
             ORDER BY updated_at DESC LIMIT $4"""
_LISTING = """SELECT * FROM (
           SELECT r.run_id, r.tenant_id, r.workflow_id, r.workflow_version, r.last_seq,
                  r.event_count, r.created_at, r.updated_at, r.completed_at, t.kind,
                  CASE WHEN t.kind = 'thread' AND r.status = 'running' AND NOT EXISTS (
                         SELECT 1 FROM graph_checkpoints g
                         WHERE g.tenant_id = r.tenant_id AND g.thread_id = r.run_id)
                       THEN 'deleted'
                       WHEN r.status = 'running' AND (r.tenant_id, r.run_id) IN
                         ({blocked_runs}) THEN '{blocked}'
                       ELSE r.status END AS status
           FROM ({picked}) r
           CROSS JOIN LATERAL (
             SELECT CASE WHEN EXISTS (
                      SELECT 1 FROM run_events e
                      WHERE e.tenant_id = r.tenant_id AND e.run_id = r.run_id
                        AND e.type LIKE 'graph.%') THEN 'thread' ELSE 'run' END AS kind) t
           ) listed
           WHERE $3::text IS NULL OR status = $3
           ORDER BY updated_at DESC"""


async def listing(
    conn: Conn,
    *,
    tenant_id: str | None,
    workflow_id: str | None,
    status: str | None,
    limit: int,
) -> list[asyncpg.Record]:
    """Runs, latest activity first (the ``limit`` newest of the status asked). ``kind``
    says which are LangGraph threads; a thread whose checkpoints were deleted
    (``adelete_thread``) shows as ``deleted`` (``running`` in its row: it may go on)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        listing_query(tenant_id, workflow_id, status), tenant_id, workflow_id, status, limit
    )
    return rows


def listing_query(tenant_id: str | None, workflow_id: str | None, status: str | None) -> str:
    """The statement :func:`listing` runs for these filters ($1 to $4: the tenant, the
    workflow, the status, the limit)."""
    whole_tenant = tenant_id is not None and workflow_id is None and status is None
    picked = _NEWEST_OF_EACH_STATUS if whole_tenant else _NEWEST
    blocked = {"blocked": BLOCKED, "blocked_runs": blocked_runs("$1")}
    return _LISTING.format(picked=picked.format(**blocked), **blocked)


# of the tenant in $1 (a RunFilter's statements)
_BLOCKED_OF_1 = blocked_runs("$1")
_SHOWN_OF_1 = shown_status("$1")

_HAS_CHECKPOINT = (
    "EXISTS (SELECT 1 FROM checkpoints c WHERE c.tenant_id = runs.tenant_id "
    "AND c.run_id = runs.run_id AND {})"
)


def _contains(text: str | None) -> str | None:
    """An ILIKE pattern for ``text`` anywhere, its own ``%``, ``_`` and ``\\`` taken
    literally. (ILIKE rather than ``strpos(lower(...))``: PostgreSQL estimates how many
    rows a pattern matches, so a rare error text is found by one scan of the failures,
    not by probing every run.)"""
    if not text:
        return None
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


@dataclass(frozen=True)
class RunFilter:
    """Which of a tenant's runs a list shows: each condition set narrows it (``text``:
    a part of the run id; ``node``: a part of a node's id that checkpointed in it;
    ``error``: a part of a failure's type or message; all three in any case;
    ``since``/``until``: when the run was created)."""

    tenant_id: str
    workflow_id: str | None = None
    status: str | None = None  # as shown: running and blocked are apart
    since: datetime | None = None
    until: datetime | None = None
    text: str | None = None
    node: str | None = None
    error: str | None = None

    def where(self, *, status: bool = True) -> tuple[str, list[Any]]:
        """The conditions as SQL over parameters $1.. (only those set: each combination
        its own statement, planned for it), and their values."""
        terms: list[str] = ["tenant_id = $1"]
        args: list[Any] = [self.tenant_id]
        if status and self.status in ("running", BLOCKED):  # as shown: blocked or not
            which = "IN" if self.status == BLOCKED else "NOT IN"
            terms.append(f"status = 'running' AND (tenant_id, run_id) {which} ({_BLOCKED_OF_1})")
        for sql, value in (
            ("workflow_id = ${}", self.workflow_id),
            (
                "status = ${}",
                self.status if status and self.status not in ("running", BLOCKED) else None,
            ),
            ("created_at >= ${}", self.since),
            ("created_at < ${}", self.until),
            ("strpos(lower(run_id), lower(${})) > 0", self.text),
            (_HAS_CHECKPOINT.format("c.node_id ILIKE ${}"), _contains(self.node)),
            (
                _HAS_CHECKPOINT.format(
                    "c.kind = 'failure' AND concat_ws(': ', c.metadata->'error'->>'type', "
                    "c.metadata->'error'->>'message') ILIKE ${}"
                ),
                _contains(self.error),
            ),
        ):
            if value is not None and value != "":
                args.append(value)
                terms.append(sql.format(len(args)))
        return " AND ".join(terms), args


# How a list may be sorted (created: by creation; duration: from when the run was first
# recorded to its completion as sent, or to the list's "as of" while it runs; status: as
# shown, worst first), and the SQL of each key over a ``runs`` row.
SORTS: Final = ("created", "duration", "status")
_WORST_LAST: Final = ("succeeded", "running", REFUSED, BLOCKED, "failed")


def _duration_ms(row: str = "", now: str = "now()") -> str:
    return (
        f"greatest(0, 1000 * extract(epoch FROM coalesce({row}completed_at, {now}) "
        f"- {row}created_at))::float8"
    )


def _sort_key(sort: str, now: str) -> str | None:
    """The SQL of ``sort``'s key over a ``runs`` row (None: creation, the index's)."""
    if sort == "duration":
        return _duration_ms(now=now)
    if sort == "status":
        return f"array_position(ARRAY{list(_WORST_LAST)!r}::text[], {_SHOWN_OF_1})"
    return None


@dataclass(frozen=True)
class Order:
    """A list's order: ``sort`` one of :data:`SORTS`, the newest, longest or worst
    first unless ``ascending``; ties go by creation, then run id, the same way. A
    page's cursor is its last row's :meth:`key`. ``as_of``: when a running run's
    duration is taken (None: now). Every page of one walk through a list by duration
    shares it, or a running run, its duration grown since the last page, would move
    across the cursor and be listed twice (or never)."""

    sort: str = "created"
    ascending: bool = False
    as_of: datetime | None = None

    def __post_init__(self) -> None:
        if self.sort not in SORTS:
            raise ValueError(f"no sort {self.sort!r}: one of {', '.join(SORTS)}")

    def key(self, row: asyncpg.Record) -> tuple[Any, ...]:
        """Where ``row`` sits in this order: the cursor of the page after it."""
        by = (row["created_at"], row["run_id"])
        return by if self.sort == "created" else (row["sort_key"], *by)


async def page(
    conn: Conn,
    f: RunFilter,
    *,
    before: tuple[Any, ...] | None,
    limit: int,
    newer_than: tuple[Any, ...] | None = None,
    order: Order = Order(),
) -> list[asyncpg.Record]:
    """Up to ``limit`` runs matching ``f`` in ``order`` (newest first by default): those
    after ``before`` (the last of the previous page's :meth:`Order.key`) when given, or
    the ``limit`` nearest of those ahead of ``newer_than`` (the first of the next page:
    the page before it). For triage, each with ``duration_ms`` (from when it was first
    recorded to its completion as sent, or to now while it runs) and, for a failed
    run, its latest failure's node and error type (``failing_node``, ``error_type``:
    read for the page's runs only, from the run's newest checkpoint back), a running
    run's duration taken at ``order.as_of``."""
    where, args = f.where()
    now = "now()"
    if order.as_of is not None:
        args.append(order.as_of)
        now = f"${len(args)}::timestamptz"
    cursor, back = (before, False) if newer_than is None else (newer_than, True)
    descending = order.ascending == back
    key = _sort_key(order.sort, now)
    columns = "created_at, run_id" if key is None else "sort_key, created_at, run_id"
    after = ""
    if cursor is not None:
        args += list(cursor)
        marks = ", ".join(f"${len(args) - i}" for i in reversed(range(len(cursor))))
        after = f"({columns}) {'<' if descending else '>'} ({marks})"
    args.append(limit)
    direction = "DESC" if descending else "ASC"
    by = ", ".join(f"{c} {direction}" for c in columns.split(", "))
    sort_key = "" if key is None else f", {key} AS sort_key"
    selected = f"""SELECT tenant_id, run_id, workflow_id, workflow_version,
                          {_SHOWN_OF_1} AS status, last_seq, event_count, projection,
                          created_at, updated_at, completed_at{sort_key}
                   FROM runs WHERE {where}"""
    if key is None:  # from the (tenant, created_at) index, no sort
        picked = f"{selected}{' AND ' + after if after else ''} ORDER BY {by} LIMIT ${len(args)}"
    else:  # every matching run's key, then the page's (a top-N sort)
        picked = f"""SELECT * FROM ({selected}) k {"WHERE " + after if after else ""}
                     ORDER BY {by} LIMIT ${len(args)}"""
    rows: list[asyncpg.Record] = await conn.fetch(
        f"""SELECT p.*, f.node_id AS failing_node, f.error_type,
                   {_duration_ms("p.", now)} AS duration_ms
            FROM ({picked}) p
            LEFT JOIN LATERAL (
              SELECT c.node_id, c.metadata->'error'->>'type' AS error_type
              FROM checkpoints c
              WHERE c.tenant_id = p.tenant_id AND c.run_id = p.run_id AND c.kind = 'failure'
              ORDER BY c.seq DESC LIMIT 1) f ON p.status = 'failed'
            ORDER BY {", ".join(f"p.{c} {direction}" for c in columns.split(", "))}""",
        *args,
    )
    return rows[::-1] if back else rows


@contextlib.asynccontextmanager
async def planned_for_values(pool: asyncpg.Pool, searching: bool) -> AsyncIterator[Conn]:
    """A connection whose statements are planned for the values they are given, when
    ``searching`` inside checkpoints: asyncpg prepares statements, and PostgreSQL's
    generic plan of ``node_id ILIKE $2`` guesses how many rows any text matches, so a
    rare error text was looked for by probing every run (the page took 387 ms over
    100,000 runs, and 125 ms planned for its values: docs/benchmarks.md). ``SET
    LOCAL``, so nothing outlives the transaction."""
    async with pool.acquire() as conn:
        if not searching:
            yield conn
            return
        async with conn.transaction(readonly=True):
            await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            yield conn


async def status_counts(conn: Conn, f: RunFilter, cap: int | None = None) -> dict[str, int]:
    """How many runs matching ``f`` but its status there are of each status; with
    ``cap``, counting stops after ``cap + 1`` runs (a sum over ``cap`` means "more"):
    a search inside checkpoints (by node or error) need not read every run to say so."""
    where, args = f.where(status=False)
    chosen = f"SELECT {_SHOWN_OF_1} AS status FROM runs WHERE {where}"
    if cap is not None:
        chosen += f" LIMIT {int(cap) + 1}"
    rows = await conn.fetch(
        f"SELECT status, count(*) AS n FROM ({chosen}) AS chosen GROUP BY status", *args
    )
    return {r["status"]: int(r["n"]) for r in rows}


async def tenants(conn: Conn, limit: int = 1000) -> list[str]:
    """The tenants that have runs (an operator's inspector lists them)."""
    rows = await conn.fetch(
        """WITH RECURSIVE t AS (
             (SELECT tenant_id FROM runs ORDER BY tenant_id LIMIT 1)
             UNION ALL
             SELECT (SELECT r.tenant_id FROM runs r WHERE r.tenant_id > t.tenant_id
                     ORDER BY r.tenant_id LIMIT 1) FROM t WHERE t.tenant_id IS NOT NULL)
           SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL LIMIT $1""",
        limit,
    )
    return [r["tenant_id"] for r in rows]


async def event_payloads(
    conn: Conn, tenant_id: str, run_id: str, event_ids: list[str]
) -> dict[str, Any]:
    """The recorded payloads of the run's ``event_ids`` (a state a node sent is its
    checkpoint's, not here), by event id: one page of the run's history."""
    rows = await conn.fetch(
        """SELECT event_id, payload FROM run_events
           WHERE tenant_id = $1 AND run_id = $2 AND event_id = ANY($3::text[])""",
        tenant_id,
        run_id,
        event_ids,
    )
    return {r["event_id"]: r["payload"] for r in rows}


async def report(conn: asyncpg.Connection, run_id: str, tenant_id: str | None) -> dict[str, Any]:
    """Everything about one run: the run, its events, checkpoints (without states),
    joins, outcome and dead letters; ``{}`` when the tenant has no such run. Without a
    tenant (an operator), the only tenant's run of this id; ContextError if several."""
    found = await conn.fetch(
        "SELECT * FROM runs WHERE run_id = $1 AND ($2::text IS NULL OR tenant_id = $2)",
        run_id,
        tenant_id,
    )
    if not found:
        return {}
    if len(found) > 1:
        tenants = ", ".join(sorted(r["tenant_id"] for r in found))
        raise errors.ContextError(f"tenants {tenants} each have a run {run_id!r}: pass --tenant")
    run = found[0]
    tenant = run["tenant_id"]
    events = await conn.fetch(
        """SELECT event_id, type, node_id, branch_id, effect, checkpoint_seq, emitted_at,
                  recorded_at, (payload->>'attempt')::int AS attempt,
                  CASE WHEN type = 'workflow.completed'
                       THEN (payload->>'duration_ms')::bigint END AS duration_ms,
                  CASE WHEN type = 'workflow.completed'
                       THEN payload->>'error_message' END AS error_message,
                  CASE WHEN type = 'branch.join' THEN payload->'reducers' END AS reducers,
                  CASE WHEN type = 'branch.join'
                       THEN payload->>'default_reducer' END AS default_reducer
           FROM run_events WHERE tenant_id = $1 AND run_id = $2
           ORDER BY ordinal""",
        tenant,
        run_id,
    )
    checkpoints = await conn.fetch(
        """SELECT seq, kind, node_id, branch_id, parent_seq, size_bytes, state_hash, created_at,
                  event_id,
                  merged_from, metadata->'error'->>'type' AS error_type,
                  metadata->'error'->>'message' AS error_message,
                  (metadata->>'attempt')::int AS attempt
           FROM checkpoints WHERE tenant_id = $1 AND run_id = $2 ORDER BY seq""",
        tenant,
        run_id,
    )
    joins = await conn.fetch(
        """SELECT join_id, status, checkpoint_seq, created_at FROM joins
           WHERE tenant_id = $1 AND run_id = $2 ORDER BY created_at""",
        tenant,
        run_id,
    )
    outcome = await conn.fetchrow(
        """SELECT success, duration_ms, node_count, nodes_succeeded, nodes_failed, error_message,
                  failing_node, task, strategy, learnings_extracted, created_at
           FROM workflow_outcomes WHERE tenant_id = $1 AND run_id = $2""",
        tenant,
        run_id,
    )
    lineage = await conn.fetchval(  # a fork's first checkpoint names where it came from
        """SELECT (metadata->'forked_from')::text FROM checkpoints
           WHERE tenant_id = $1 AND run_id = $2 AND seq = 1""",
        tenant,
        run_id,
    )
    blocked_by = await blocking_letters(conn, tenant, run_id)
    return {
        "run": run,
        "forked_from": json.loads(lineage) if lineage else None,
        "forks": await forks(conn, tenant, run_id),
        "events": events,
        "checkpoints": checkpoints,
        "joins": joins,
        "outcome": outcome,
        "dead_letters": await dead_letters.of_run(conn, run_id, tenant),
        # the letters it waits on: its status shown is blocked while there are any
        "blocked_by": blocked_by,
        "status": BLOCKED if blocked_by else run["status"],
    }


# The forks a run's page and `alma runs show` list, newest first (and how many in all).
FORKS_SHOWN = 20


async def forks(
    conn: Conn, tenant_id: str, run_id: str, limit: int = FORKS_SHOWN
) -> list[asyncpg.Record]:
    """The runs forked from ``run_id``, newest first, at most ``limit`` (each with
    ``run_id``, the ``seq`` it started from, the edit's ``note``, ``asked_by`` and
    whether a ``patched`` state, when, and ``total``: how many forks in all), from the
    lineage in each fork's first checkpoint (index ``checkpoints_forks``)."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT run_id, (metadata->'forked_from'->>'seq')::bigint AS seq,
                  metadata->'forked_from'->>'note' AS note,
                  metadata->'forked_from'->>'asked_by' AS asked_by,
                  metadata->'forked_from' ? 'patch' AS patched, created_at,
                  count(*) OVER ()::int AS total
           FROM checkpoints
           WHERE tenant_id = $1 AND metadata->'forked_from'->>'run_id' = $2
             AND seq = 1 AND metadata ? 'forked_from'
           ORDER BY created_at DESC, run_id DESC LIMIT $3""",
        tenant_id,
        run_id,
        limit,
    )
    return rows


# How many of a workflow's latest finished runs tell which nodes it usually reaches.
OTHER_RUNS = 20


async def reached_elsewhere(
    conn: Conn, tenant_id: str, workflow_id: str, run_id: str, runs: int = OTHER_RUNS
) -> tuple[dict[str, int], int]:
    """The nodes the workflow's ``runs`` latest finished runs other than ``run_id``
    reached (a checkpoint of theirs names the node: a node's, a failure's or a
    merge's), each with how many of those runs did, and how many runs were looked at."""
    # The limit written into the statement, and each run's nodes read by its own index
    # lookup: with ``LIMIT $4`` the generic plan of a prepared statement (asyncpg's)
    # guessed 1,409 runs and hashed them against every checkpoint of the tenant (56 ms at
    # 200,000 checkpoints: docs/benchmarks.md).
    rows = await conn.fetch(
        f"""WITH others AS MATERIALIZED (
              SELECT run_id FROM runs
              WHERE tenant_id = $1 AND workflow_id = $2 AND run_id <> $3
                AND status IN ('succeeded', 'failed')
              ORDER BY created_at DESC LIMIT {int(runs)})
            SELECT n.node_id, count(*)::int AS runs,
                   (SELECT count(*) FROM others)::int AS looked_at
            FROM others o CROSS JOIN LATERAL (
              SELECT DISTINCT c.node_id FROM checkpoints c
              WHERE c.tenant_id = $1 AND c.run_id = o.run_id AND c.node_id IS NOT NULL) n
            GROUP BY n.node_id""",
        tenant_id,
        workflow_id,
        run_id,
    )
    return {r["node_id"]: r["runs"] for r in rows}, (rows[0]["looked_at"] if rows else 0)


async def path(conn: Conn, tenant_id: str, run_id: str) -> tuple[list[asyncpg.Record], Any]:
    """A run's checkpoints in seq order without their states (seq, kind, node, branch,
    state hash), and its lineage when it is a fork (else None): what two runs are
    compared by. No checkpoints: ``([], None)``."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """SELECT seq, kind, node_id, branch_id, state_hash,
                  CASE WHEN seq = 1 THEN (metadata->'forked_from')::text END AS lineage
           FROM checkpoints WHERE tenant_id = $1 AND run_id = $2 ORDER BY seq""",
        tenant_id,
        run_id,
    )
    lineage = rows[0]["lineage"] if rows else None
    return rows, json.loads(lineage) if lineage else None


async def counts(conn: Conn, run_pattern: str, tenants: list[str]) -> dict[str, int]:
    """How many rows of each kind runs matching ``run_pattern`` (SQL LIKE) left, and
    the memories of ``tenants`` (the demo's summary)."""
    row = await conn.fetchrow(
        """SELECT (SELECT count(*) FROM runs WHERE run_id LIKE $1) AS runs,
                  (SELECT count(*) FROM checkpoints WHERE run_id LIKE $1) AS checkpoints,
                  (SELECT count(*) FROM joins WHERE run_id LIKE $1) AS joins,
                  (SELECT count(*) FROM workflow_outcomes WHERE run_id LIKE $1) AS outcomes,
                  (SELECT count(*) FROM dead_letters WHERE run_id LIKE $1) AS dead_letters,
                  (SELECT count(*) FROM memories WHERE tenant_id = ANY($2)) AS memories""",
        run_pattern,
        tenants,
    )
    return {k: int(v) for k, v in dict(row).items()}


async def outcomes_count(conn: Conn, run_pattern: str) -> int:
    """Outcomes learned for runs matching ``run_pattern`` (SQL LIKE)."""
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM workflow_outcomes WHERE run_id LIKE $1", run_pattern
        )
    )
