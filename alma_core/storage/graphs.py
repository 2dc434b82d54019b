"""LangGraph threads in PostgreSQL: the rows ``graph.*`` events become (written by the
checkpointer in its batch transaction, so exactly once and in the thread's order), and
the reads a LangGraph checkpointer makes (:mod:`alma_core.integrations.langgraph`).

* ``graph.checkpoint``: the checkpoint (JSON, without its channel values) and the
  values of the channels it changed, one blob per (channel, version), written once;
* ``graph.writes``: a task's pending writes; special channels (errors, interrupts)
  replace, the others are kept once per (task, index);
* ``graph.upkeep``: delete a thread, delete the checkpoints of LangGraph runs, prune
  (keep each namespace's latest, or delete all), copy a thread to another.

A checkpoint's values are those of its ``channel_versions``: each channel's blob at
that version (a read assembles them in the same query).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import asyncpg

from alma_core.schemas.events import (
    GraphCheckpoint,
    GraphCheckpointPayload,
    GraphUpkeep,
    GraphWrites,
    GraphWritesPayload,
)
from alma_core.sequencing import EventRow
from alma_core.storage import runs
from alma_core.storage.postgres import is_storage_failure, storage_error

Conn: TypeAlias = asyncpg.Connection


def _bytes(data: str) -> bytes | None:
    return base64.b64decode(data) if data else None


# --- writes (in the checkpointer's batch transaction) ----------------------------------


async def insert(conn: Conn, rows: list[EventRow]) -> None:
    """Write the batch's LangGraph rows, in the order of their events."""
    for row in rows:
        event = row.event
        if isinstance(event, GraphCheckpoint):
            await _checkpoint(conn, event.tenant_id, event.run_id, event.payload)
        elif isinstance(event, GraphWrites):
            await _writes(conn, event.tenant_id, event.run_id, event.payload)
        elif isinstance(event, GraphUpkeep):
            await _upkeep(conn, event)


async def _checkpoint(conn: Conn, tenant: str, thread: str, p: GraphCheckpointPayload) -> None:
    run_id = p.metadata.get("run_id")
    await conn.execute(
        """INSERT INTO graph_checkpoints (tenant_id, thread_id, checkpoint_ns, checkpoint_id,
               parent_checkpoint_id, run_id, checkpoint, metadata)
           VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8::jsonb)
           ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET
               parent_checkpoint_id = EXCLUDED.parent_checkpoint_id, run_id = EXCLUDED.run_id,
               checkpoint = EXCLUDED.checkpoint, metadata = EXCLUDED.metadata""",
        tenant,
        thread,
        p.checkpoint_ns,
        p.checkpoint_id,
        p.parent_checkpoint_id,
        run_id if isinstance(run_id, str) else None,
        p.checkpoint,
        p.metadata,
    )
    if p.new_versions:
        await conn.executemany(
            """INSERT INTO graph_blobs (tenant_id, thread_id, checkpoint_ns, channel, version,
                   type, blob)
               VALUES ($1, $2, $3, $4, $5, $6, $7)
               ON CONFLICT DO NOTHING""",
            [
                (tenant, thread, p.checkpoint_ns, channel, str(v), value.type, _bytes(value.data))
                for channel, v in p.new_versions.items()
                if (value := p.values.get(channel)) is not None
            ],
        )


async def _writes(conn: Conn, tenant: str, thread: str, p: GraphWritesPayload) -> None:
    conflict = (
        """ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx)
           DO UPDATE SET channel = EXCLUDED.channel, type = EXCLUDED.type,
                         blob = EXCLUDED.blob, task_path = EXCLUDED.task_path"""
        if p.replace
        else "ON CONFLICT DO NOTHING"
    )
    await conn.executemany(
        f"""INSERT INTO graph_writes (tenant_id, thread_id, checkpoint_ns, checkpoint_id,
                task_id, idx, channel, type, blob, task_path)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) {conflict}""",
        [
            (
                *(tenant, thread, p.checkpoint_ns, p.checkpoint_id, p.task_id, w.idx),
                *(w.channel, w.value.type, _bytes(w.value.data), p.task_path),
            )
            for w in p.writes
        ],
    )


_TABLES = ("graph_writes", "graph_blobs", "graph_checkpoints")


async def _upkeep(conn: Conn, event: GraphUpkeep) -> None:
    p, tenant, thread = event.payload, event.tenant_id, event.run_id
    if p.deletes_thread:
        for table in _TABLES:
            await conn.execute(
                f"DELETE FROM {table} WHERE tenant_id = $1 AND thread_id = $2", tenant, thread
            )
    elif p.op == "delete_runs":
        await _delete_checkpoints(
            conn, tenant, thread, "{c}.run_id = ANY($3::text[])", p.run_ids or []
        )
        await _drop_unheld_values(conn, tenant, thread)
    elif p.op == "prune":  # keep_latest: each namespace's newest checkpoint
        await _delete_checkpoints(
            conn,
            tenant,
            thread,
            """{c}.checkpoint_id < (SELECT max(k.checkpoint_id) FROM graph_checkpoints k
                                   WHERE k.tenant_id = $1 AND k.thread_id = $2
                                     AND k.checkpoint_ns = {c}.checkpoint_ns)""",
        )
        await _drop_unheld_values(conn, tenant, thread)
    elif p.op == "copy":
        await _copy(conn, tenant, thread, p.target_thread_id or thread)


def _holds(c: str, channel: str) -> str:
    """SQL: checkpoint ``c`` stores a value of ``channel``: inline in its JSON (a
    primitive, or a snapshot's marker), or as the blob of the channel's version there.
    What a delta channel's rebuild stops at (LangGraph's ``get_delta_channel_history``)."""
    return f"""(coalesce({c}.checkpoint->'channel_values' ? {channel}, false) OR EXISTS (
                  SELECT 1 FROM graph_blobs hb
                  WHERE hb.tenant_id = {c}.tenant_id AND hb.thread_id = {c}.thread_id
                    AND hb.checkpoint_ns = {c}.checkpoint_ns AND hb.channel = {channel}
                    AND hb.version = {c}.checkpoint->'channel_versions'->>{channel}
                    AND hb.type <> 'empty'))"""


def _needed_by(survivor: str) -> str:
    """SQL of a recursive CTE ``needed(ns, checkpoint_id, channel)``: the checkpoints of
    thread $2 (tenant $1) a checkpoint that stays (``survivor``, a condition on ``s``)
    is rebuilt from. A LangGraph delta channel (named in the checkpoint's
    ``counters_since_delta_snapshot``: written since its last snapshot) is stored as
    the writes of each step after its nearest snapshot: every checkpoint back to that
    snapshot, with its writes, is needed, or the channel reads empty."""
    return f"""needed(ns, checkpoint_id, channel) AS (
            SELECT s.checkpoint_ns, s.parent_checkpoint_id, d.channel
            FROM graph_checkpoints s
            CROSS JOIN LATERAL jsonb_object_keys(
                coalesce(s.metadata->'counters_since_delta_snapshot', '{{}}'::jsonb)) d(channel)
            WHERE s.tenant_id = $1 AND s.thread_id = $2 AND ({survivor})
              AND s.parent_checkpoint_id IS NOT NULL
              AND coalesce(s.checkpoint->'channel_versions' ? d.channel, false)
              AND NOT {_holds("s", "d.channel")}
          UNION
            SELECT a.checkpoint_ns, a.parent_checkpoint_id, n.channel
            FROM needed n JOIN graph_checkpoints a
              ON a.tenant_id = $1 AND a.thread_id = $2 AND a.checkpoint_ns = n.ns
             AND a.checkpoint_id = n.checkpoint_id
            WHERE a.parent_checkpoint_id IS NOT NULL AND NOT {_holds("a", "n.channel")})"""


async def _delete_checkpoints(conn: Conn, tenant: str, thread: str, where: str, *args: Any) -> None:
    """Delete the thread's checkpoints matching ``where`` (``{c}`` names the row) and
    their writes, but never one a checkpoint that stays is rebuilt from
    (:func:`_needed_by`): what LangGraph's delta channels need is kept, so no later
    state loses what it held."""
    survivor = f"({where.format(c='s')}) IS NOT TRUE"
    await conn.execute(
        f"""WITH RECURSIVE {_needed_by(survivor)},
            gone AS (
                DELETE FROM graph_checkpoints c
                WHERE c.tenant_id = $1 AND c.thread_id = $2 AND {where.format(c="c")}
                  AND NOT EXISTS (SELECT 1 FROM needed n WHERE n.ns = c.checkpoint_ns
                                                           AND n.checkpoint_id = c.checkpoint_id)
                RETURNING c.checkpoint_ns, c.checkpoint_id)
            DELETE FROM graph_writes w USING gone
            WHERE w.tenant_id = $1 AND w.thread_id = $2
              AND w.checkpoint_ns = gone.checkpoint_ns AND w.checkpoint_id = gone.checkpoint_id""",
        tenant,
        thread,
        *args,
    )


async def _drop_unheld_values(conn: Conn, tenant: str, thread: str) -> None:
    """Delete the thread's values no checkpoint left holds (after checkpoints went)."""
    await conn.execute(
        """DELETE FROM graph_blobs b WHERE b.tenant_id = $1 AND b.thread_id = $2
           AND NOT EXISTS (
               SELECT 1 FROM graph_checkpoints c
               WHERE c.tenant_id = b.tenant_id AND c.thread_id = b.thread_id
                 AND c.checkpoint_ns = b.checkpoint_ns
                 AND c.checkpoint->'channel_versions'->>b.channel = b.version)""",
        tenant,
        thread,
    )


async def _copy(conn: Conn, tenant: str, source: str, target: str) -> None:
    """Every checkpoint, value and write of ``source`` again under ``target``."""
    columns = {
        "graph_checkpoints": "checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, "
        "checkpoint, metadata",
        "graph_blobs": "checkpoint_ns, channel, version, type, blob",
        "graph_writes": "checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob, "
        "task_path",
    }
    for table, cols in columns.items():
        await conn.execute(
            f"""INSERT INTO {table} (tenant_id, thread_id, {cols})
                SELECT tenant_id, $3, {cols} FROM {table}
                WHERE tenant_id = $1 AND thread_id = $2
                ON CONFLICT DO NOTHING""",
            tenant,
            source,
            target,
        )


# --- reads (the LangGraph checkpointer's) ---------------------------------------------


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint as stored: its JSON, its channel values and pending writes as the
    serializer wrote them (type, bytes)."""

    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_checkpoint_id: str | None
    checkpoint: dict[str, Any]
    metadata: dict[str, Any]
    values: list[tuple[str, str, bytes | None]]  # channel, type, bytes
    writes: list[tuple[str, str, str, bytes | None, str, int]]  # task, channel, type, bytes,
    # task path, index


_SELECT = """
SELECT c.thread_id, c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id, c.checkpoint,
       c.metadata,
       (SELECT coalesce(jsonb_agg(jsonb_build_array(b.channel, b.type,
                                                    encode(b.blob, 'base64'))), '[]')
          FROM jsonb_each_text(c.checkpoint->'channel_versions') v(channel, version)
          JOIN graph_blobs b ON b.tenant_id = c.tenant_id AND b.thread_id = c.thread_id
                            AND b.checkpoint_ns = c.checkpoint_ns AND b.channel = v.channel
                            AND b.version = v.version) AS vals,
       (SELECT coalesce(jsonb_agg(jsonb_build_array(w.task_id, w.channel, w.type,
                                                    encode(w.blob, 'base64'), w.task_path,
                                                    w.idx)), '[]')
          FROM graph_writes w
          WHERE w.tenant_id = c.tenant_id AND w.thread_id = c.thread_id
            AND w.checkpoint_ns = c.checkpoint_ns AND w.checkpoint_id = c.checkpoint_id)
          AS writes
FROM graph_checkpoints c"""


def _stored(row: asyncpg.Record) -> StoredCheckpoint:
    def raw(text: str | None) -> bytes | None:
        return base64.b64decode(text) if text else None

    vals, writes = row["vals"], row["writes"]
    vals = json.loads(vals) if isinstance(vals, str) else vals
    writes = json.loads(writes) if isinstance(writes, str) else writes
    return StoredCheckpoint(
        thread_id=row["thread_id"],
        checkpoint_ns=row["checkpoint_ns"],
        checkpoint_id=row["checkpoint_id"],
        parent_checkpoint_id=row["parent_checkpoint_id"],
        checkpoint=row["checkpoint"],
        metadata=row["metadata"],
        values=[(ch, t, raw(b)) for ch, t, b in vals],
        writes=[(task, ch, t, raw(b), path, idx) for task, ch, t, b, path, idx in writes],
    )


async def _guarded_fetch(pool: asyncpg.Pool, sql: str, *args: Any) -> list[asyncpg.Record]:
    try:
        rows: list[asyncpg.Record] = await pool.fetch(sql, *args)
    except Exception as exc:
        if is_storage_failure(exc):
            raise storage_error(exc, "reading a LangGraph thread") from exc
        raise
    return rows


def _not_others(thread: str) -> str:
    """A thread another graph owns (not released) is not this graph's to read: $5 is the
    graph (None: any), in every query that says it. ``thread`` is ``$2`` when the query
    names one thread: then the check is one primary-key lookup, made once per query. The
    same check against each row's ``c.thread_id`` let PostgreSQL hash every unreleased run
    of the database for a thread it expected many rows of, whatever the LIMIT: a latest
    checkpoint of a 3,000-checkpoint thread took 42 ms with 100,000 runs stored, 0.4 ms
    this way (2026-11-29, CHANGELOG.md). Across threads, per row."""
    return f"""($5::text IS NULL OR NOT EXISTS (
                  SELECT 1 FROM runs r WHERE r.tenant_id = $1
                    AND r.run_id = {thread} AND r.workflow_id <> $5
                    AND r.released_at IS NULL))"""


async def outline(pool: asyncpg.Pool, tenant: str, thread: str, limit: int) -> list[asyncpg.Record]:
    """A thread's checkpoints, newest first, without their values (namespace, id,
    parent, LangGraph's step and source, when written): what `alma checkpoints` and
    `alma resume` show of a LangGraph thread."""
    return await _guarded_fetch(
        pool,
        """SELECT checkpoint_ns, checkpoint_id, parent_checkpoint_id,
                  (metadata->>'step')::int AS step, metadata->>'source' AS source, created_at
           FROM graph_checkpoints WHERE tenant_id = $1 AND thread_id = $2
           ORDER BY checkpoint_id DESC LIMIT $3""",
        tenant,
        thread,
        limit,
    )


@dataclass(frozen=True)
class ThreadSummary:
    """What a thread's outcome counts: each node whose tasks finished and whether one of
    them failed, the first error, and when the thread's run began."""

    nodes: dict[str, bool]
    first_error: str | None
    started_at: datetime | None


# One checkpoint of a thread's namespace ($1 tenant, $2 thread, $3 namespace): by id
# ($4), else the newest; $5 the reading graph (None: any)
ONE_CHECKPOINT = f"""{_SELECT}
    WHERE c.tenant_id = $1 AND c.thread_id = $2 AND c.checkpoint_ns = $3
      AND ($4::text IS NULL OR c.checkpoint_id = $4)
      AND {_not_others("$2")}
    ORDER BY c.checkpoint_id DESC LIMIT 1"""


@dataclass(frozen=True)
class DeltaRows:
    """What a checkpoint's delta channels are rebuilt from, as stored: per channel, the
    writes of the checkpoints back to its nearest stored value, unordered (checkpoint
    id, task path, task id, index, type, bytes: the saver orders them as LangGraph
    does), and that value (``seeds``: the blob's type and bytes, or the inline JSON
    value as ``("json", value)``)."""

    writes: dict[str, list[tuple[str, str, str, int, str, bytes | None]]]
    seeds: dict[str, tuple[str, Any]]


# LangGraph snapshots a delta channel within 5,000 supersteps: a walk longer than this
# is a chain of parents that loops (a hostile producer's ids), not a history
MAX_WALK = 10_000

# A checkpoint's delta channels ($6) in one query: from the checkpoint ($4; None: the
# newest of namespace $3) each channel walks its parent chain (one primary-key lookup a
# step) to the nearest ancestor holding a value of it; the writes of the walked
# checkpoints and that value come back. The target's own writes are pending, not part.
DELTA_HISTORY = f"""
WITH RECURSIVE target AS (
    SELECT c.parent_checkpoint_id FROM graph_checkpoints c
    WHERE c.tenant_id = $1 AND c.thread_id = $2 AND c.checkpoint_ns = $3
      AND ($4::text IS NULL OR c.checkpoint_id = $4) AND {_not_others("$2")}
    ORDER BY c.checkpoint_id DESC LIMIT 1),
walk(checkpoint_id, parent_id, channel, holds, depth) AS (
    SELECT a.checkpoint_id, a.parent_checkpoint_id, ch.channel, {_holds("a", "ch.channel")}, 1
    FROM target t CROSS JOIN unnest($6::text[]) ch(channel)
    JOIN graph_checkpoints a ON a.tenant_id = $1 AND a.thread_id = $2
     AND a.checkpoint_ns = $3 AND a.checkpoint_id = t.parent_checkpoint_id
  UNION ALL
    SELECT a.checkpoint_id, a.parent_checkpoint_id, w.channel, {_holds("a", "w.channel")},
           w.depth + 1
    FROM walk w JOIN graph_checkpoints a ON a.tenant_id = $1 AND a.thread_id = $2
     AND a.checkpoint_ns = $3 AND a.checkpoint_id = w.parent_id
    WHERE NOT w.holds AND w.depth < {MAX_WALK})
SELECT w.channel, w.checkpoint_id, x.task_id, x.idx, x.task_path, x.type, x.blob,
       NULL::jsonb AS inline, false AS seed
FROM walk w JOIN graph_writes x ON x.tenant_id = $1 AND x.thread_id = $2
 AND x.checkpoint_ns = $3 AND x.checkpoint_id = w.checkpoint_id AND x.channel = w.channel
UNION ALL
SELECT w.channel, w.checkpoint_id, NULL, NULL, NULL, b.type, b.blob,
       a.checkpoint->'channel_values'->w.channel, true
FROM walk w JOIN graph_checkpoints a ON a.tenant_id = $1 AND a.thread_id = $2
 AND a.checkpoint_ns = $3 AND a.checkpoint_id = w.checkpoint_id
LEFT JOIN graph_blobs b ON b.tenant_id = $1 AND b.thread_id = $2 AND b.checkpoint_ns = $3
 AND b.channel = w.channel AND b.version = a.checkpoint->'channel_versions'->>w.channel
 AND b.type <> 'empty'
WHERE w.holds"""


@dataclass(frozen=True)
class GraphReader:
    """One tenant's reads of LangGraph threads, for a saver: every query carries the
    tenant, and with ``workflow`` a thread another graph owns (not released) is not
    read. The saver holds this, never a pool."""

    pool: asyncpg.Pool
    tenant: str
    workflow: str | None = None

    async def get(
        self, thread: str, ns: str, checkpoint_id: str | None, *, any_graph: bool = False
    ) -> StoredCheckpoint | None:
        """One checkpoint of the thread's namespace: by id, or the newest (of a thread
        another graph owns too when ``any_graph``)."""
        rows = await _guarded_fetch(
            self.pool,
            ONE_CHECKPOINT,
            self.tenant,
            thread,
            ns,
            checkpoint_id,
            None if any_graph else self.workflow,
        )
        return _stored(rows[0]) if rows else None

    async def listing(
        self,
        *,
        thread: str | None,
        ns: str | None,
        checkpoint_id: str | None,
        metadata: dict[str, Any] | None,
        before: str | None,
        limit: int | None,
    ) -> list[StoredCheckpoint]:
        """The tenant's checkpoints, newest first, narrowed as LangGraph's ``list``
        asks."""
        rows = await _guarded_fetch(
            self.pool,
            f"""{_SELECT}
                WHERE c.tenant_id = $1 AND ($2::text IS NULL OR c.thread_id = $2)
                  AND ($3::text IS NULL OR c.checkpoint_ns = $3)
                  AND ($4::text IS NULL OR c.checkpoint_id = $4)
                  AND {_not_others("c.thread_id" if thread is None else "$2")}
                  AND ($6::jsonb IS NULL OR c.metadata @> $6::jsonb)
                  AND ($7::text IS NULL OR c.checkpoint_id < $7)
                ORDER BY c.checkpoint_id DESC
                LIMIT $8""",
            self.tenant,
            thread,
            ns,
            checkpoint_id,
            self.workflow,
            metadata,
            before,
            limit,
        )
        return [_stored(r) for r in rows]

    async def delta_history(
        self, thread: str, ns: str, checkpoint_id: str | None, channels: list[str]
    ) -> DeltaRows:
        """What the checkpoint's delta ``channels`` are rebuilt from (:class:`DeltaRows`),
        in one query whatever the distance to their snapshots."""
        rows = await _guarded_fetch(
            self.pool,
            DELTA_HISTORY,
            self.tenant,
            thread,
            ns,
            checkpoint_id,
            self.workflow,
            channels,
        )
        found = DeltaRows({}, {})
        writes, seeds = found.writes, found.seeds
        for r in rows:
            if not r["seed"]:
                writes.setdefault(r["channel"], []).append(
                    (
                        r["checkpoint_id"],
                        r["task_path"],
                        r["task_id"],
                        r["idx"],
                        r["type"],
                        r["blob"],
                    )
                )
            elif r["type"] is not None:  # a blob wins: a snapshot's inline value is a marker
                seeds[r["channel"]] = (r["type"], r["blob"])
            else:
                inline = r["inline"]
                seeds[r["channel"]] = (
                    "json",
                    json.loads(inline) if isinstance(inline, str) else inline,
                )
        return found

    async def threads_of_runs(self, run_ids: list[str]) -> list[str]:
        """The threads holding checkpoints of these LangGraph runs."""
        rows = await _guarded_fetch(
            self.pool,
            """SELECT DISTINCT thread_id FROM graph_checkpoints
               WHERE tenant_id = $1 AND run_id = ANY($2::text[]) ORDER BY 1""",
            self.tenant,
            run_ids,
        )
        return [r["thread_id"] for r in rows]

    async def owner(self, thread: str) -> str | None:
        """The graph (workflow) that owns the thread's run, if any."""
        return await runs.owner(self.pool, self.tenant, thread)

    async def unrecorded(self, thread: str, event_ids: list[str]) -> list[str]:
        """Those of ``event_ids`` the thread's run has no effect of yet."""
        return await runs.unrecorded(self.pool, self.tenant, thread, event_ids)

    async def summary(self, thread: str) -> ThreadSummary:
        """What the thread's outcome counts (:class:`ThreadSummary`)."""
        rows = await _guarded_fetch(
            self.pool,
            """SELECT e.node_id, e.payload->'error'->>'type' AS error_type,
                      e.payload->'error'->>'message' AS error_message
               FROM run_events e
               WHERE e.tenant_id = $1 AND e.run_id = $2 AND e.type = 'graph.writes'
                 AND e.node_id IS NOT NULL
               ORDER BY e.ordinal""",
            self.tenant,
            thread,
        )
        nodes: dict[str, bool] = {}
        first_error = None
        for r in rows:
            failed = r["error_type"] is not None
            nodes[r["node_id"]] = nodes.get(r["node_id"], False) or failed
            if failed and first_error is None:
                first_error = f"{r['node_id']}: {r['error_type']}: {r['error_message']}"
        started = await _guarded_fetch(
            self.pool,
            "SELECT created_at FROM runs WHERE tenant_id = $1 AND run_id = $2",
            self.tenant,
            thread,
        )
        return ThreadSummary(nodes, first_error, started[0]["created_at"] if started else None)
