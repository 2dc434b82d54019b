"""What replay reads and writes (:mod:`alma_core.replay`): the runs chosen, and each
run's events as recorded (rebuilt into contract events), its stored checkpoints and its
workflow's reducers, read in one snapshot so events applied meanwhile are neither half
seen nor mistaken for differences; and a run's migration to a new projection
(:func:`migrate`), written in one transaction under the run's lock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from alma_core import replay
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.replay import Difference, Stored
from alma_core.schemas.events import EVENT_MODELS, Event, EventType
from alma_core.sequencing import RunView, canonical_state, hash_scheme, state_hash
from alma_core.storage import reducer_configs
from alma_core.storage.checkpoint_rows import COUNT_STORED
from alma_core.storage.checkpoints import STATE_IN_CHECKPOINT

BATCH = 500  # runs listed per query


@dataclass(frozen=True)
class RunInputs:
    run: RunView
    events: list[Event]
    stored: dict[int, Stored]
    config: ReducerConfig | None
    skipped: str | None = None  # why it cannot replay
    projection: int = 0  # how many times its checkpoints were rebuilt


async def chosen(
    conn: asyncpg.Connection,
    *,
    tenant_id: str | None,
    workflow_id: str | None = None,
    run_id: str | None = None,
    since: datetime | None = None,
) -> AsyncIterator[tuple[str, str]]:
    """(tenant, run) of every run matching, oldest activity first, in pages."""
    after: tuple[str, str] = ("", "")
    while True:
        rows = await conn.fetch(
            """SELECT tenant_id, run_id FROM runs
               WHERE ($1::text IS NULL OR tenant_id = $1)
                 AND ($2::text IS NULL OR workflow_id = $2)
                 AND ($3::text IS NULL OR run_id = $3)
                 AND ($4::timestamptz IS NULL OR updated_at >= $4)
                 AND (tenant_id, run_id) > ($5, $6)
               ORDER BY tenant_id, run_id LIMIT $7""",
            tenant_id,
            workflow_id,
            run_id,
            since,
            *after,
            BATCH,
        )
        for r in rows:
            yield r["tenant_id"], r["run_id"]
        if len(rows) < BATCH:
            return
        after = (rows[-1]["tenant_id"], rows[-1]["run_id"])


async def load(conn: asyncpg.Connection, tenant_id: str, run_id: str) -> RunInputs | None:
    """One run's replay inputs, in one snapshot (a read-only repeatable-read
    transaction); None for no such run. ``conn`` decodes JSON as ALMA's pools do
    (:func:`alma_core.storage.postgres.connect`)."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        return await _read(conn, tenant_id, run_id, lock=False)


async def _read(
    conn: asyncpg.Connection, tenant_id: str, run_id: str, *, lock: bool
) -> RunInputs | None:
    """A run's replay inputs, in the caller's transaction; with ``lock``, the run row is
    read first and ``FOR UPDATE`` (the lock the checkpointer and the joiner take), so
    what follows is read after every batch that wrote to the run committed."""
    run = await conn.fetchrow(
        """SELECT workflow_id, workflow_version, projection,
                  checkpoints_pruned_at IS NOT NULL OR events_pruned_at IS NOT NULL
                    AS pruned
           FROM runs WHERE tenant_id = $1 AND run_id = $2"""
        + (" FOR UPDATE" if lock else ""),
        tenant_id,
        run_id,
    )
    if run is None:
        return None
    rows = await conn.fetch(
        """SELECT event_id, type, node_id, branch_id, emitted_at, checkpoint_seq, payload
           FROM run_events WHERE tenant_id = $1 AND run_id = $2 AND type NOT LIKE 'graph.%'
           ORDER BY ordinal""",
        tenant_id,
        run_id,
    )
    checkpoints = await conn.fetch(
        """SELECT seq, kind, state_hash, state, event_id, branch_id, parent_seq
           FROM checkpoints WHERE tenant_id = $1 AND run_id = $2 ORDER BY seq""",
        tenant_id,
        run_id,
    )
    config = await reducer_configs.load(conn, tenant_id, run["workflow_id"])
    view = RunView(run_id, tenant_id, run["workflow_id"], run["workflow_version"])
    stored = {
        c["seq"]: Stored(c["seq"], c["kind"], c["state_hash"], c["state"], c["event_id"])
        for c in checkpoints
    }
    projection = int(run["projection"])
    if run["pruned"]:
        why = "retention pruned its events or checkpoints"
        return RunInputs(view, [], stored, config, why, projection)
    lost = sorted({r["checkpoint_seq"] for r in rows if r["checkpoint_seq"]} - set(stored))
    if lost:
        why = f"its checkpoints were deleted (seq {lost[0]} and on: cleanup_checkpoints)"
        return RunInputs(view, [], stored, config, why, projection)
    folded = _folded_failures(checkpoints)
    events = [_event(r, view, stored, folded) for r in rows]
    return RunInputs(view, events, stored, config, projection=projection)


@dataclass(frozen=True)
class Migrated:
    """One run's migration: the projection it is in now, the checkpoints rewritten (0:
    its checkpoints were already what the reducers make), or why it was left as it is
    (``skipped``: cannot replay; ``refused``: its refold would change its seqs)."""

    tenant_id: str
    run_id: str
    projection: int
    changed: int = 0
    skipped: str | None = None
    refused: Difference | None = None

    def to_doc(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "run_id": self.run_id,
            "projection": self.projection,
            "changed": self.changed,
            "skipped": self.skipped,
            "refused": self.refused.to_doc() if self.refused else None,
        }


async def migrate(
    conn: asyncpg.Connection,
    tenant_id: str,
    run_id: str,
    *,
    registry: ReducerRegistry,
    max_state_bytes: int,
) -> Migrated | None:
    """Rebuild the run's checkpoints with its workflow's reducers as registered now, as
    projection N+1, in one transaction holding the run's lock: the run takes no event
    meanwhile, and readers see all of projection N or all of N+1 (every read of a
    run's checkpoints is one statement, and a cached head is served only while its
    hash is PostgreSQL's). The states replaced are kept in ``superseded_checkpoints``
    as projection N. None: no such run."""
    async with conn.transaction():
        inputs = await _read(conn, tenant_id, run_id, lock=True)
        if inputs is None:
            return None
        if inputs.skipped:
            return Migrated(tenant_id, run_id, inputs.projection, skipped=inputs.skipped)
        folded = replay.refold(
            inputs.run,
            inputs.events,
            inputs.stored,
            config=inputs.config,
            registry=registry,
            max_state_bytes=max_state_bytes,
        )
        plan = replay.rebuild(inputs.stored, folded)
        if plan.refused is not None or not plan.changed:
            return Migrated(tenant_id, run_id, inputs.projection, refused=plan.refused)
        encoded = [canonical_state(cp.state, hash_scheme(cp.state_hash)) for cp in plan.changed]
        await conn.execute(
            _SWITCH,
            tenant_id,
            run_id,
            inputs.projection,
            [cp.seq for cp in plan.changed],
            [state for state, _, _ in encoded],
            [digest for _, digest, _ in encoded],
            [size for _, _, size in encoded],
        )
    return Migrated(tenant_id, run_id, inputs.projection + 1, changed=len(plan.changed))


# A run's switch to its next projection, one statement: the replaced states kept as
# projection $3, the checkpoints and the heads' hashes rewritten, the run's projection
# counted, the tenant's kept bytes moved by the sizes' change. Sibling CTEs see one
# snapshot: `superseded` and `counted` read the states as they were.
_SWITCH = (
    """
WITH rebuilt AS (
    SELECT * FROM unnest($4::bigint[], $5::text[], $6::text[], $7::int[]) AS u(s, j, h, z)
), superseded AS (
    INSERT INTO superseded_checkpoints (tenant_id, run_id, projection, seq, state,
                                        state_hash, size_bytes)
    SELECT c.tenant_id, c.run_id, $3, c.seq, c.state, c.state_hash, c.size_bytes
    FROM checkpoints c JOIN rebuilt ON c.seq = rebuilt.s
    WHERE c.tenant_id = $1 AND c.run_id = $2
), rewritten AS (
    UPDATE checkpoints c SET state = rebuilt.j::json, state_hash = rebuilt.h,
                             size_bytes = rebuilt.z
    FROM rebuilt WHERE c.tenant_id = $1 AND c.run_id = $2 AND c.seq = rebuilt.s
), heads AS (
    UPDATE run_heads h SET state_hash = rebuilt.h
    FROM rebuilt WHERE h.tenant_id = $1 AND h.run_id = $2 AND h.seq = rebuilt.s
), counted AS ("""
    + COUNT_STORED.format(
        source="""(SELECT c.tenant_id, (rebuilt.z - c.size_bytes)::bigint
            FROM checkpoints c JOIN rebuilt ON c.seq = rebuilt.s
            WHERE c.tenant_id = $1 AND c.run_id = $2)"""
    )
    + """
)
UPDATE runs SET projection = $3 + 1 WHERE tenant_id = $1 AND run_id = $2
"""
)


def _event(row: asyncpg.Record, run: RunView, stored: dict[int, Stored], folded: set[int]) -> Event:
    """The contract event an audit row records. A state given in full is not in the
    row: it is the state of the checkpoint the event made (or found unchanged)."""
    payload: dict[str, Any] = dict(row["payload"])
    seq = row["checkpoint_seq"]
    given = payload.pop(STATE_IN_CHECKPOINT, False) or (
        # rows written before the mark: a completion always has a state or updates; a
        # failure without either folded its branch's head (``folded``)
        not ({"state", "updates"} & set(payload))
        and (row["type"] == "node.completed" or seq not in folded)
    )
    if row["type"] in ("node.completed", "node.failed") and given and seq in stored:
        payload["state"] = stored[seq].state
    doc = {
        "event_id": row["event_id"],
        "type": row["type"],
        "emitted_at": row["emitted_at"],
        "tenant_id": run.tenant_id,
        "workflow_id": run.workflow_id,
        "workflow_version": run.workflow_version,
        "run_id": run.run_id,
        "node_id": row["node_id"],
        "branch_id": row["branch_id"],
        "payload": payload,
    }
    model = EVENT_MODELS[EventType(row["type"])]
    return model.model_validate(doc, strict=False)  # type: ignore[return-value]


def _folded_failures(checkpoints: list[asyncpg.Record]) -> set[int]:
    """Failures whose state is what folding their branch's head gives (the head's state,
    or ``{}`` on a branch with none yet): the seqs of failures recorded without a state
    before the audit log marked a given one."""
    by_seq = {c["seq"]: c for c in checkpoints}
    folded: set[int] = set()
    for c in checkpoints:
        if c["kind"] != "failure":
            continue
        parent = by_seq.get(c["parent_seq"])
        same_branch = parent is not None and parent["branch_id"] == c["branch_id"]
        empty = state_hash({}, hash_scheme(c["state_hash"]))
        head_hash = parent["state_hash"] if same_branch and parent else empty
        if c["state_hash"] == head_hash:
            folded.add(c["seq"])
    return folded
