"""What a batch reads of its runs, written once for the checkpointer and the joiner:
lock the batch's runs (:func:`lock_runs`), then everything else it needs in one more
statement (:func:`load_locked`: heads, reducer configs, event ids used before).

Both consumers take the run rows' locks first, in one order (tenant, run id), so their
batches never deadlock with each other, with ``alma replay --apply`` (the same lock) or
with themselves; what they read after it cannot change until they commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import asyncpg

from alma_core.reducers import ReducerConfig
from alma_core.sequencing import Head, HeadKey, RunKey, RunView
from alma_core.storage.postgres import columns

LOCK_RUNS = """
SELECT r.run_id, r.tenant_id, r.workflow_id, r.workflow_version, r.status,
       r.last_seq, r.event_count, r.completed_at,
       r.released_at IS NOT NULL AS released,
       (r.checkpoints_pruned_at IS NOT NULL OR r.events_pruned_at IS NOT NULL) AS pruned
FROM runs r JOIN unnest($1::text[], $2::text[]) AS u(t, r)
  ON r.tenant_id = u.t AND r.run_id = u.r
ORDER BY r.tenant_id, r.run_id FOR UPDATE OF r
"""

# Heads of the runs (with their states for the runs flagged), reducer configs of the
# workflows, and (tenant, event id) -> run for the ids named: three parts, one statement.
LOAD_LOCKED = """
SELECT
  (SELECT coalesce(json_agg(json_build_array(h.tenant_id, h.run_id, h.branch_key, h.seq,
                                             h.state_hash, CASE WHEN u.f THEN c.state END)),
                   '[]')
   FROM run_heads h
   JOIN unnest($1::text[], $2::text[], $3::bool[]) AS u(t, r, f)
     ON h.tenant_id = u.t AND h.run_id = u.r
   LEFT JOIN checkpoints c ON u.f AND c.tenant_id = h.tenant_id
                          AND c.run_id = h.run_id AND c.seq = h.seq) AS heads,
  (SELECT coalesce(json_agg(json_build_array(rc.tenant_id, rc.workflow_id, rc.config)), '[]')
   FROM reducer_configs rc
   JOIN unnest($4::text[], $5::text[]) AS u(t, w)
     ON rc.tenant_id = u.t AND rc.workflow_id = u.w) AS configs,
  (SELECT coalesce(json_agg(json_build_array(e.tenant_id, e.event_id, e.run_id)), '[]')
   FROM run_events e
   JOIN unnest($6::text[], $7::text[]) AS u(t, i)
     ON e.tenant_id = u.t AND e.event_id = u.i) AS known
"""


async def lock_runs(conn: asyncpg.Connection, runs: Iterable[RunKey]) -> dict[RunKey, RunView]:
    """Lock the runs' rows (in one order) and read them; a run with no row is absent."""
    tenants, run_ids = columns(sorted(set(runs)), 2)
    rows = await conn.fetch(LOCK_RUNS, tenants, run_ids)
    return {(r["tenant_id"], r["run_id"]): RunView(**dict(r)) for r in rows}


@dataclass(frozen=True)
class Locked:
    """What :func:`load_locked` read: heads (a state only where asked for), each
    workflow's registered reducers, and the run of each (tenant, event id) seen before."""

    heads: dict[HeadKey, Head]
    configs: dict[tuple[str, str], ReducerConfig]
    known: dict[tuple[str, str], str]


async def load_locked(
    conn: asyncpg.Connection,
    runs: Iterable[RunKey],
    *,
    with_state: set[RunKey],
    workflows: Iterable[tuple[str, str]] = (),
    event_ids: Iterable[tuple[str, str]] = (),
) -> Locked:
    """After :func:`lock_runs`, in one round trip: every head of ``runs`` (with its state
    for the runs in ``with_state``), the reducer configs of ``workflows`` (tenant,
    workflow id) and the runs of ``event_ids`` (tenant, event id) already recorded."""
    tenants, run_ids = columns(sorted(set(runs)), 2)
    flags = [run in with_state for run in zip(tenants, run_ids, strict=True)]
    row = await conn.fetchrow(
        LOAD_LOCKED,
        tenants,
        run_ids,
        flags,
        *columns(sorted(set(workflows)), 2),
        *columns(sorted(set(event_ids)), 2),
    )
    assert row is not None
    return Locked(
        heads={
            (t, r, key): Head(seq, state_hash, state or {})
            for t, r, key, seq, state_hash, state in row["heads"]
        },
        configs={(t, w): ReducerConfig.from_json(config) for t, w, config in row["configs"]},
        known={(t, i): r for t, i, r in row["known"]},
    )
