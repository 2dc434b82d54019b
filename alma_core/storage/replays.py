"""What replay reads (:mod:`alma_core.replay`): the runs chosen, and each run's events as
recorded (rebuilt into contract events), its stored checkpoints and its workflow's
reducers, read in one snapshot so events applied meanwhile are neither half seen nor
mistaken for differences."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from alma_core.reducers import ReducerConfig
from alma_core.replay import Stored
from alma_core.sequencing import RunView
from alma_core.storage import reducer_configs
from schemas.events import EVENT_MODELS, Event, EventType

BATCH = 500  # runs listed per query


@dataclass(frozen=True)
class RunInputs:
    run: RunView
    events: list[Event]
    stored: dict[int, Stored]
    config: ReducerConfig | None
    skipped: str | None = None  # why it cannot replay


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
        run = await conn.fetchrow(
            """SELECT workflow_id, workflow_version,
                      checkpoints_pruned_at IS NOT NULL OR events_pruned_at IS NOT NULL
                        AS pruned
               FROM runs WHERE tenant_id = $1 AND run_id = $2""",
            tenant_id,
            run_id,
        )
        if run is None:
            return None
        rows = await conn.fetch(
            """SELECT event_id, type, node_id, branch_id, emitted_at, checkpoint_seq,
                      payload
               FROM run_events WHERE tenant_id = $1 AND run_id = $2 AND type NOT LIKE 'graph.%'
               ORDER BY ordinal""",
            tenant_id,
            run_id,
        )
        checkpoints = await conn.fetch(
            """SELECT seq, kind, state_hash, state, event_id FROM checkpoints
               WHERE tenant_id = $1 AND run_id = $2 ORDER BY seq""",
            tenant_id,
            run_id,
        )
        config = await reducer_configs.load(conn, tenant_id, run["workflow_id"])
    view = RunView(run_id, tenant_id, run["workflow_id"], run["workflow_version"])
    stored = {
        c["seq"]: Stored(c["seq"], c["kind"], c["state_hash"], c["state"], c["event_id"])
        for c in checkpoints
    }
    if run["pruned"]:
        return RunInputs(view, [], stored, config, "retention pruned its events or checkpoints")
    lost = sorted({r["checkpoint_seq"] for r in rows if r["checkpoint_seq"]} - set(stored))
    if lost:
        why = f"its checkpoints were deleted (seq {lost[0]} and on: cleanup_checkpoints)"
        return RunInputs(view, [], stored, config, why)
    events = [_event(r, view, stored) for r in rows]
    return RunInputs(view, events, stored, config)


def _event(row: asyncpg.Record, run: RunView, stored: dict[int, Stored]) -> Event:
    """The contract event an audit row records. A state given in full is not in the
    row: it is the state of the checkpoint the event made (or found unchanged)."""
    payload: dict[str, Any] = dict(row["payload"])
    seq = row["checkpoint_seq"]
    given = {"state", "updates"} & set(payload)
    if row["type"] in ("node.completed", "node.failed") and not given and seq in stored:
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
