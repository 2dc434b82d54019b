"""What a batch reads of its runs, written once for the checkpointer and the joiner:
lock the batch's runs (:func:`lock_runs`), then everything else it needs in one more
statement (:func:`load_locked`: heads, reducer configs, event ids used before). The
checkpointer, which knows what it reads before the locks, does the offsets' fence, the
locks and the reads in one statement (:func:`fence_and_load`), or, outside any
transaction, the same reads without a lock (:func:`load_unlocked`), with each run's row
version, which its write then checks (:mod:`alma_core.storage.checkpoints`).

Both consumers take the run rows' locks first, in one order (tenant, run id), so their
batches never deadlock with each other, with ``alma replay --apply`` (the same lock) or
with themselves; what they read after it cannot change until they commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import asyncpg

from alma_core.reducers import ReducerConfig
from alma_core.sequencing import Head, HeadKey, RunKey, RunView
from alma_core.storage import offsets
from alma_core.storage.offsets import R
from alma_core.storage.postgres import columns

_RUN_COLUMNS = """r.run_id, r.tenant_id, r.workflow_id, r.workflow_version, r.status,
       r.last_seq, r.event_count, r.completed_at,
       r.released_at IS NOT NULL AS released,
       (r.checkpoints_pruned_at IS NOT NULL OR r.events_pruned_at IS NOT NULL) AS pruned"""

LOCK_RUNS = f"""
SELECT {_RUN_COLUMNS}
FROM runs r JOIN unnest($1::text[], $2::text[]) AS u(t, r)
  ON r.tenant_id = u.t AND r.run_id = u.r
ORDER BY r.tenant_id, r.run_id FOR UPDATE OF r
"""

# Heads of the runs (with their states for the runs flagged), reducer configs of the
# workflows, and (tenant, event id) -> run for the ids named: three parts, one statement
# (its placeholders named, so that :data:`FENCE_LOCK_LOAD` can hold it too).
_LOADS = """
  (SELECT coalesce(json_agg(json_build_array(h.tenant_id, h.run_id, h.branch_key, h.seq,
                                             h.state_hash, CASE WHEN u.f THEN c.state END)),
                   '[]')
   FROM run_heads h
   JOIN unnest({tenants}::text[], {run_ids}::text[], {flags}::bool[]) AS u(t, r, f)
     ON h.tenant_id = u.t AND h.run_id = u.r
   LEFT JOIN checkpoints c ON u.f AND c.tenant_id = h.tenant_id
                          AND c.run_id = h.run_id AND c.seq = h.seq) AS heads,
  (SELECT coalesce(json_agg(json_build_array(rc.tenant_id, rc.workflow_id, rc.config,
                                             rc.xmin::text)), '[]')
   FROM reducer_configs rc
   JOIN unnest({wf_tenants}::text[], {workflows}::text[]) AS u(t, w)
     ON rc.tenant_id = u.t AND rc.workflow_id = u.w) AS configs,
  (SELECT coalesce(json_agg(json_build_array(e.tenant_id, e.event_id, e.run_id)), '[]')
   FROM run_events e
   JOIN unnest({ev_tenants}::text[], {event_ids}::text[]) AS u(t, i)
     ON e.tenant_id = u.t AND e.event_id = u.i) AS known
"""


def _loads(first: int) -> str:
    """:data:`_LOADS` with its seven values numbered from ``first``."""
    names = ("tenants", "run_ids", "flags", "wf_tenants", "workflows", "ev_tenants", "event_ids")
    return _LOADS.format(**{name: f"${first + i}" for i, name in enumerate(names)})


LOAD_LOCKED = "SELECT" + _loads(1)

# The checkpointer's first round trip: the fence (offsets.FENCE), the runs' locks and
# LOAD_LOCKED's reads in one statement. The locks are taken in the two statements'
# order (the offsets' rows first: the runs' scan waits on the fence), but the reads see
# the statement's snapshot, taken before any lock: ``stale`` says whether a transaction
# committed on these rows between the two (a lock waited on, a row changed since the
# snapshot: an offset moved, a run row of another version, a new one), and then the
# reads are done again after the locks (:func:`fence_and_load`).
FENCE_LOCK_LOAD = (
    """WITH seen_offsets AS (
  SELECT o.topic, o.partition, o.next_offset FROM consumer_offsets o
  JOIN unnest($3::text[], $4::int[]) AS u(t, p) ON o.topic = u.t AND o.partition = u.p
  WHERE o.group_id = $1 AND o.cluster_id = $2
), fence AS (
"""
    + offsets.FENCE.format(group="$1", cluster="$2", topics="$3", partitions="$4", firsts="$5")
    + """
), locked AS (
  SELECT """
    + _RUN_COLUMNS
    + """, r.xmin::text AS version
  FROM runs r JOIN unnest($6::text[], $7::text[]) AS u(t, r)
    ON r.tenant_id = u.t AND r.run_id = u.r
  WHERE (SELECT count(*) FROM fence) >= 0
  ORDER BY r.tenant_id, r.run_id FOR UPDATE OF r
), seen_runs AS (
  SELECT r.tenant_id, r.run_id, r.xmin::text AS version
  FROM runs r JOIN unnest($6::text[], $7::text[]) AS u(t, r)
    ON r.tenant_id = u.t AND r.run_id = u.r
)
SELECT
  (SELECT coalesce(json_agg(json_build_array(f.topic, f.partition, f.next_offset)), '[]')
   FROM fence f) AS offsets,
  (SELECT coalesce(json_agg(json_build_array(l.run_id, l.tenant_id, l.workflow_id,
                                             l.workflow_version, l.status, l.last_seq,
                                             l.event_count, l.completed_at, l.released,
                                             l.pruned)), '[]')
   FROM locked l) AS runs,
  EXISTS (SELECT 1 FROM fence f LEFT JOIN seen_offsets s
            ON s.topic = f.topic AND s.partition = f.partition
          WHERE CASE WHEN s.topic IS NULL THEN NOT f.inserted
                     ELSE s.next_offset <> f.next_offset END)
  OR EXISTS (SELECT 1 FROM locked l FULL JOIN seen_runs s
               ON s.tenant_id = l.tenant_id AND s.run_id = l.run_id
             WHERE l.version IS DISTINCT FROM s.version) AS stale,"""
    + _loads(6)
)


# The same reads as committed, outside a transaction and without a lock (a row lock would
# make the statement a writing transaction: a WAL flush of its own): each partition's
# stored offset, each run with its row version, the loads. Nothing is fenced: the write
# that follows checks that the offsets and the runs are still these.
LOAD_UNLOCKED = (
    """SELECT
  (SELECT coalesce(json_agg(json_build_array(o.topic, o.partition, o.next_offset)), '[]')
   FROM consumer_offsets o
   JOIN unnest($3::text[], $4::int[]) AS u(t, p) ON o.topic = u.t AND o.partition = u.p
   WHERE o.group_id = $1 AND o.cluster_id = $2) AS offsets,
  (SELECT coalesce(json_agg(json_build_array(r.run_id, r.tenant_id, r.workflow_id,
                                             r.workflow_version, r.status, r.last_seq,
                                             r.event_count, r.completed_at, r.released,
                                             r.pruned, r.version)), '[]')
   FROM (SELECT """
    + _RUN_COLUMNS
    + """, r.xmin::text AS version
         FROM runs r JOIN unnest($5::text[], $6::text[]) AS u(t, r)
           ON r.tenant_id = u.t AND r.run_id = u.r) r) AS runs,"""
    + _loads(5)
)


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
    config_versions: dict[tuple[str, str], str] = field(default_factory=dict)  # row xmin


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
    return _locked(row)


def _locked(row: asyncpg.Record) -> Locked:
    return Locked(
        heads={
            (t, r, key): Head(seq, state_hash, state or {})
            for t, r, key, seq, state_hash, state in row["heads"]
        },
        configs={(t, w): ReducerConfig.from_json(config) for t, w, config, _ in row["configs"]},
        known={(t, i): r for t, i, r in row["known"]},
        config_versions={(t, w): version for t, w, _, version in row["configs"]},
    )


@dataclass(frozen=True)
class Wants:
    """What a batch reads of its runs: the runs (locked), those whose head states it
    folds into, the workflows whose reducers it needs, the event ids it must know."""

    runs: set[RunKey]
    with_state: set[RunKey]
    workflows: set[tuple[str, str]]
    event_ids: set[tuple[str, str]]


@dataclass(frozen=True)
class Reads:
    """A batch's runs, locked, and what it read of them after the locks."""

    runs: dict[RunKey, RunView]
    locked: Locked
    read_again: bool = False  # a lock waited on a commit: read again after the locks
    # each run's row version (xmin) as read without a lock (:func:`load_unlocked`);
    # empty for reads under the locks
    versions: dict[RunKey, str] = field(default_factory=dict)
    # runs whose every head's state was held (folded from the checkpointer's memory)
    states_known: frozenset[RunKey] = frozenset()


async def lock_and_load(conn: asyncpg.Connection, wants: Wants) -> Reads:
    """:func:`lock_runs`, then :func:`load_locked`: two round trips."""
    runs = await lock_runs(conn, wants.runs)
    loaded = await load_locked(
        conn,
        wants.runs,
        with_state=wants.with_state,
        workflows=wants.workflows,
        event_ids=wants.event_ids,
    )
    return Reads(runs, loaded)


async def fence_and_load(
    conn: asyncpg.Connection,
    group_id: str,
    cluster_id: str,
    batch: dict[offsets.PartitionKey, list[R]],
    wants: Wants,
) -> tuple[offsets.Fence[R], Reads]:
    """The fence (:func:`offsets.fence`) and :func:`lock_and_load` in one round trip
    (:data:`FENCE_LOCK_LOAD`); a second one, the reads again, when a transaction
    committed on these rows while the statement began (``Reads.read_again``)."""
    tenants, run_ids = columns(sorted(wants.runs), 2)
    row = await conn.fetchrow(
        FENCE_LOCK_LOAD,
        *offsets.fence_args(group_id, cluster_id, batch),
        tenants,
        run_ids,
        [run in wants.with_state for run in zip(tenants, run_ids, strict=True)],
        *columns(sorted(wants.workflows), 2),
        *columns(sorted(wants.event_ids), 2),
    )
    assert row is not None
    fence = offsets.fenced(batch, {(t, p): n for t, p, n in row["offsets"]})
    if row["stale"]:
        return fence, replace(await lock_and_load(conn, wants), read_again=True)
    runs = {(view.tenant_id, view.run_id): view for view in map(_run_view, row["runs"])}
    return fence, Reads(runs, _locked(row))


def _run_view(fields: list[Any]) -> RunView:
    """A run as the statements' ``json_build_array`` gives it (its first ten columns)."""
    r, t, w, v, status, last_seq, count, done, released, pruned = fields[:10]
    return RunView(
        run_id=r,
        tenant_id=t,
        workflow_id=w,
        workflow_version=v,
        status=status,
        last_seq=last_seq,
        event_count=count,
        completed_at=None if done is None else datetime.fromisoformat(done),
        released=released,
        pruned=pruned,
    )


@dataclass(frozen=True)
class Unlocked:
    """What :func:`load_unlocked` read: each partition's stored next offset (a partition
    with no row yet is absent) and the batch's reads, with each run's row version."""

    stored: dict[offsets.PartitionKey, int]
    reads: Reads


async def load_unlocked(
    conn: asyncpg.Connection,
    group_id: str,
    cluster_id: str,
    batch: dict[offsets.PartitionKey, list[R]],
    wants: Wants,
) -> Unlocked:
    """:data:`LOAD_UNLOCKED`: one round trip, outside a transaction, taking no lock."""
    tenants, run_ids = columns(sorted(wants.runs), 2)
    _, _, topics, partitions, _ = offsets.fence_args(group_id, cluster_id, batch)
    row = await conn.fetchrow(
        LOAD_UNLOCKED,
        group_id,
        cluster_id,
        topics,
        partitions,
        tenants,
        run_ids,
        [run in wants.with_state for run in zip(tenants, run_ids, strict=True)],
        *columns(sorted(wants.workflows), 2),
        *columns(sorted(wants.event_ids), 2),
    )
    assert row is not None
    views = {(f[1], f[0]): (_run_view(f), f[10]) for f in row["runs"]}
    return Unlocked(
        stored={(t, p): n for t, p, n in row["offsets"]},
        reads=Reads(
            {key: view for key, (view, _) in views.items()},
            _locked(row),
            versions={key: version for key, (_, version) in views.items()},
        ),
    )
