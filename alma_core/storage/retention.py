"""Retention: every table that grows with traffic is pruned, in bounded batches.

Lifetimes (days; 0 keeps forever; :class:`RetentionPolicy`, from the settings):

* a closed run (its ``workflow.completed`` recorded) loses, in steps recorded on
  its row: its **checkpoints** and branch heads, then its **event log** (the audit
  trail and inbox) and stored **join replies**, last the **run row** itself. A
  LangGraph thread is left to LangGraph's own ``adelete_thread`` and ``aprune`` (a
  thread goes on after ``acomplete``: a chat's next turn), as with its own savers;
* **dead letters** and the learner's **node-outcome memories** age out by their
  creation time. Outcomes (``workflow_outcomes``) stay: learning counts them;
* **superseded checkpoint states** (a run's earlier projection, kept by ``alma replay
  --apply``) age out by the time they were replaced, and go with their run's
  checkpoints in any case.

A tenant may keep its closed runs' checkpoints for a time of its own (``alma tenants
set T --checkpoint-retention-days D``, table ``tenant_settings``; 0: forever), read by
each round: the checkpoints step then runs even where the global lifetime is 0.

A run without its completion is never pruned, however old. Once a step touched a
run, the run takes no more events (:class:`errors.RunPruned`): an event replayed
after its inbox row was deleted is refused, never applied again. That holds while
the run row exists, so the run lifetime must exceed how long the broker keeps the
lifecycle topic (docs/operations.md).

Each batch is its own short transaction that locks the runs it takes with ``SKIP
LOCKED``: pruning never waits for the checkpointer, and two pruners never collide.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from alma_core.settings import RetentionPolicy
from alma_core.storage.checkpoint_rows import COUNT_STORED
from alma_core.storage.postgres import columns, is_storage_failure, storage_error

RunKeys = list[tuple[str, str]]  # (tenant, run id)


@dataclass
class PruneResult:
    """What one call pruned. ``runs`` and ``pruned``: runs whose checkpoints went (their
    cache entries are to be forgotten); ``more``: a step stopped at its batch limit."""

    runs: int = 0
    checkpoints: int = 0
    events: int = 0
    joins: int = 0
    runs_deleted: int = 0
    dead_letters: int = 0
    outcome_memories: int = 0
    superseded: int = 0
    batches: int = 0
    more: bool = False
    pruned: RunKeys = field(default_factory=list)

    def rows(self) -> dict[str, int]:
        """Rows deleted per table group (metrics, the CLI's table)."""
        return {
            "checkpoints": self.checkpoints,
            "run_events": self.events,
            "joins": self.joins,
            "runs": self.runs_deleted,
            "dead_letters": self.dead_letters,
            "outcome_memories": self.outcome_memories,
            "superseded_checkpoints": self.superseded,
        }


async def delete_checkpoints(conn: asyncpg.Connection, runs: RunKeys) -> int:
    """Delete these runs' checkpoints, branch heads and superseded states in the
    caller's transaction (the checkpoints' sizes taken from their tenants' kept bytes
    in the same statement); how many checkpoints went."""
    tenants, run_ids = columns(runs, 2)
    deleted = await conn.fetchval(
        """WITH gone AS (
             DELETE FROM checkpoints c USING unnest($1::text[], $2::text[]) u(t, r)
             WHERE c.tenant_id = u.t AND c.run_id = u.r
             RETURNING c.tenant_id, -c.size_bytes::bigint AS size
           ), counted AS ("""
        + COUNT_STORED.format(source="gone")
        + """)
           SELECT count(*) FROM gone""",
        tenants,
        run_ids,
    )
    await conn.execute(
        """DELETE FROM run_heads h USING unnest($1::text[], $2::text[]) u(t, r)
           WHERE h.tenant_id = u.t AND h.run_id = u.r""",
        tenants,
        run_ids,
    )
    await _delete_of_runs(conn, "superseded_checkpoints", "run_id", runs)
    return int(deleted or 0)


async def prune(
    pool: asyncpg.Pool, policy: RetentionPolicy, *, batch_runs: int = 200, max_batches: int = 50
) -> PruneResult:
    """Every step the policy sets, each at most ``max_batches`` batches of ``batch_runs``
    runs (or rows) per call; ``more`` says a step had work left."""
    result = PruneResult()
    # a tenant's own checkpoint lifetime holds where the global one is 0 (forever) too
    checkpoints = policy.checkpoints_days > 0 or await _tenants_keep_checkpoints_less(pool)
    steps: list[tuple[float, Step, bool]] = [
        (policy.checkpoints_days, _checkpoints_batch, checkpoints),
        (policy.events_days, _events_batch, False),
        (policy.runs_days, _runs_batch, False),
        (policy.dead_letters_days, _dead_letters_batch, False),
        (policy.outcome_memories_days, _outcome_memories_batch, False),
        (policy.superseded_days, _superseded_batch, False),
    ]
    for days, step, anyway in steps:
        if days > 0 or anyway:
            await _batches(pool, step, days, batch_runs, max_batches, result)
    return result


async def _tenants_keep_checkpoints_less(pool: asyncpg.Pool) -> bool:
    """Whether a tenant keeps its checkpoints for a time of its own (not forever)."""
    try:
        return bool(
            await pool.fetchval(
                """SELECT EXISTS (SELECT 1 FROM tenant_settings
                                  WHERE checkpoint_retention_days > 0)"""
            )
        )
    except Exception as exc:
        if is_storage_failure(exc):
            raise storage_error(exc, "reading tenants' retention") from exc
        raise


# -- steps: each one batch in the caller's transaction; False when nothing was left --

Step = Callable[[asyncpg.Connection, float, int, PruneResult], Awaitable[bool]]


async def _batches(
    pool: asyncpg.Pool, step: Step, days: float, size: int, max_batches: int, result: PruneResult
) -> None:
    try:
        for _ in range(max_batches):
            async with pool.acquire() as conn, conn.transaction():
                if not await step(conn, days * 86400.0, size, result):
                    return
            result.batches += 1
        result.more = True
    except Exception as exc:
        if is_storage_failure(exc):
            raise storage_error(exc, "pruning old rows") from exc
        raise


async def _closed_runs(
    conn: asyncpg.Connection, unpruned: str, age_s: float, n: int, *, own: str | None = None
) -> RunKeys:
    """Up to ``n`` runs completed more than ``age_s`` ago (0: never) whose ``unpruned``
    column is NULL, oldest first, locked (skipping runs someone else holds). ``own``:
    the ``tenant_settings`` column of days that, where a tenant set it, replaces
    ``age_s`` for its runs (0: never)."""
    # typed here: its first use (``> 0``) would make it an integer, and 1e-9 days 0
    lifetime = "$1::float8" if own is None else f"coalesce(ts.{own} * 86400.0, $1::float8)"
    tenants = "" if own is None else "LEFT JOIN tenant_settings ts ON ts.tenant_id = runs.tenant_id"
    rows = await conn.fetch(
        f"""SELECT runs.tenant_id, runs.run_id FROM runs {tenants}
            WHERE completed_at IS NOT NULL AND {unpruned} IS NULL
              AND {lifetime} > 0
              AND completed_at < now() - make_interval(secs => {lifetime})
              AND NOT EXISTS (SELECT 1 FROM graph_checkpoints g
                              WHERE g.tenant_id = runs.tenant_id AND g.thread_id = runs.run_id)
            ORDER BY completed_at LIMIT $2
            FOR UPDATE OF runs SKIP LOCKED""",
        age_s,
        n,
    )
    return [(r["tenant_id"], r["run_id"]) for r in rows]


async def _mark(conn: asyncpg.Connection, column: str, runs: RunKeys) -> None:
    tenants, run_ids = columns(runs, 2)
    await conn.execute(
        f"""UPDATE runs r SET {column} = now() FROM unnest($1::text[], $2::text[]) u(t, r)
            WHERE r.tenant_id = u.t AND r.run_id = u.r""",
        tenants,
        run_ids,
    )


async def _delete_of_runs(conn: asyncpg.Connection, table: str, key: str, runs: RunKeys) -> int:
    tenants, run_ids = columns(runs, 2)
    deleted = await conn.fetchval(
        f"""WITH gone AS (
              DELETE FROM {table} x USING unnest($1::text[], $2::text[]) u(t, r)
              WHERE x.tenant_id = u.t AND x.{key} = u.r RETURNING 1)
            SELECT count(*) FROM gone""",
        tenants,
        run_ids,
    )
    return int(deleted or 0)


async def _checkpoints_batch(
    conn: asyncpg.Connection, age_s: float, n: int, result: PruneResult
) -> bool:
    runs = await _closed_runs(
        conn, "checkpoints_pruned_at", age_s, n, own="checkpoint_retention_days"
    )
    if not runs:
        return False
    result.checkpoints += await delete_checkpoints(conn, runs)
    await _mark(conn, "checkpoints_pruned_at", runs)
    result.runs += len(runs)
    result.pruned += runs
    return True


async def _events_batch(
    conn: asyncpg.Connection, age_s: float, n: int, result: PruneResult
) -> bool:
    runs = await _closed_runs(conn, "events_pruned_at", age_s, n)
    if not runs:
        return False
    result.events += await _delete_of_runs(conn, "run_events", "run_id", runs)
    result.joins += await _delete_of_runs(conn, "joins", "run_id", runs)
    await _mark(conn, "events_pruned_at", runs)
    return True


async def _runs_batch(conn: asyncpg.Connection, age_s: float, n: int, result: PruneResult) -> bool:
    """Run rows whose checkpoints and events are gone (what is left cascades)."""
    deleted = await _delete_oldest(
        conn,
        "runs",
        "tenant_id, run_id",
        "checkpoints_pruned_at IS NOT NULL AND events_pruned_at IS NOT NULL AND completed_at",
        age_s,
        n,
    )
    result.runs_deleted += deleted
    return bool(deleted)


async def _dead_letters_batch(
    conn: asyncpg.Connection, age_s: float, n: int, result: PruneResult
) -> bool:
    deleted = await _delete_oldest(conn, "dead_letters", "id", "created_at", age_s, n)
    result.dead_letters += deleted
    return bool(deleted)


async def _superseded_batch(
    conn: asyncpg.Connection, age_s: float, n: int, result: PruneResult
) -> bool:
    """Earlier projections' states, open runs' too (no run reads them to go on)."""
    key = "tenant_id, run_id, projection, seq"
    deleted = await _delete_oldest(conn, "superseded_checkpoints", key, "superseded_at", age_s, n)
    result.superseded += deleted
    return bool(deleted)


async def _delete_oldest(
    conn: asyncpg.Connection, table: str, key: str, aged: str, age_s: float, n: int
) -> int:
    """Delete up to ``n`` rows of ``table`` whose ``aged`` column (the last term of the
    condition) is older than ``age_s``, oldest first, skipping rows others hold."""
    column = aged.rsplit(" ", 1)[-1]
    deleted = await conn.fetchval(
        f"""WITH gone AS (
              DELETE FROM {table} WHERE ({key}) IN (
                SELECT {key} FROM {table}
                WHERE {aged} < now() - make_interval(secs => $1)
                ORDER BY {column} LIMIT $2 FOR UPDATE SKIP LOCKED)
              RETURNING 1)
            SELECT count(*) FROM gone""",
        age_s,
        n,
    )
    return int(deleted or 0)


async def _outcome_memories_batch(
    conn: asyncpg.Connection, age_s: float, n: int, result: PruneResult
) -> bool:
    """Node-outcome memories and their artifact links."""
    gone = await conn.fetch(
        """DELETE FROM memories WHERE id IN (
             SELECT id FROM memories
             WHERE kind = 'outcome' AND created_at < now() - make_interval(secs => $1)
             ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED)
           RETURNING id""",
        age_s,
        n,
    )
    if not gone:
        return False
    await conn.execute(
        """DELETE FROM artifact_links WHERE owner_type = 'memory' AND owner_id = ANY($1::uuid[])""",
        [r["id"] for r in gone],
    )
    result.outcome_memories += len(gone)
    return True
