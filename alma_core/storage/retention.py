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
    caller's transaction; how many checkpoints went."""
    tenants, run_ids = columns(runs, 2)
    deleted = await conn.fetchval(
        """WITH gone AS (
             DELETE FROM checkpoints c USING unnest($1::text[], $2::text[]) u(t, r)
             WHERE c.tenant_id = u.t AND c.run_id = u.r RETURNING 1)
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
    steps: list[tuple[float, Step]] = [
        (policy.checkpoints_days, _checkpoints_batch),
        (policy.events_days, _events_batch),
        (policy.runs_days, _runs_batch),
        (policy.dead_letters_days, _dead_letters_batch),
        (policy.outcome_memories_days, _outcome_memories_batch),
        (policy.superseded_days, _superseded_batch),
    ]
    for days, step in steps:
        if days > 0:
            await _batches(pool, step, days, batch_runs, max_batches, result)
    return result


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


async def _closed_runs(conn: asyncpg.Connection, unpruned: str, age_s: float, n: int) -> RunKeys:
    """Up to ``n`` runs completed more than ``age_s`` ago whose ``unpruned`` column is
    NULL, oldest first, locked (skipping runs someone else holds)."""
    rows = await conn.fetch(
        f"""SELECT tenant_id, run_id FROM runs
            WHERE completed_at IS NOT NULL AND {unpruned} IS NULL
              AND completed_at < now() - make_interval(secs => $1)
              AND NOT EXISTS (SELECT 1 FROM graph_checkpoints g
                              WHERE g.tenant_id = runs.tenant_id AND g.thread_id = runs.run_id)
            ORDER BY completed_at LIMIT $2
            FOR UPDATE SKIP LOCKED""",
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
    runs = await _closed_runs(conn, "checkpoints_pruned_at", age_s, n)
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
