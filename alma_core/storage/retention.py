"""Retention: the checkpoints of runs that completed long ago are pruned, in
bounded batches, and never those of a run that is still open.

A run is closed once its ``workflow.completed`` was recorded (``completed_at``);
a run without it keeps every checkpoint, however old. Each batch is its own
short transaction that skips runs another pruner holds (``SKIP LOCKED``), so
pruning never blocks the checkpointer for long and two pruners never collide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import asyncpg

from alma_core.storage.postgres import is_storage_failure, storage_error


@dataclass
class PruneResult:
    runs: int = 0
    checkpoints: int = 0
    batches: int = 0
    more: bool = False  # stopped at max_batches with work left
    pruned: list[tuple[str, str]] = field(default_factory=list)  # (tenant, run id)


async def delete_checkpoints(conn: asyncpg.Connection, runs: list[tuple[str, str]]) -> int:
    """Delete these runs' checkpoints and branch heads, (tenant, run id) each, in the
    caller's transaction; how many checkpoints went."""
    tenants, run_ids = [t for t, _ in runs], [r for _, r in runs]
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
    return int(deleted or 0)


async def prune_checkpoints(
    pool: asyncpg.Pool,
    older_than_days: float,
    *,
    batch_runs: int = 200,
    max_batches: int = 50,
) -> PruneResult:
    """Delete the checkpoints (and branch heads) of runs completed more than
    ``older_than_days`` ago; at most ``max_batches`` × ``batch_runs`` runs per call."""
    result = PruneResult()
    try:
        for _ in range(max_batches):
            async with pool.acquire() as conn, conn.transaction():
                runs = await conn.fetch(
                    """SELECT r.tenant_id, r.run_id FROM runs r
                       WHERE r.completed_at IS NOT NULL
                         AND r.completed_at < now() - make_interval(secs => $1)
                         AND EXISTS (SELECT 1 FROM run_heads h
                                     WHERE h.tenant_id = r.tenant_id AND h.run_id = r.run_id)
                       ORDER BY r.completed_at
                       LIMIT $2
                       FOR UPDATE OF r SKIP LOCKED""",
                    older_than_days * 86400.0,
                    batch_runs,
                )
                if not runs:
                    return result
                keys = [(r["tenant_id"], r["run_id"]) for r in runs]
                deleted = await delete_checkpoints(conn, keys)
            result.runs += len(keys)
            result.pruned += keys
            result.checkpoints += deleted
            result.batches += 1
        result.more = True
        return result
    except Exception as exc:
        if is_storage_failure(exc):
            raise storage_error(exc, "pruning checkpoints") from exc
        raise
