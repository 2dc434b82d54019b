"""PostgresJoinStore: merge requests handed on by the checkpointer become merged
checkpoints and replies, exactly once, in one transaction per batch: load what the
batch's joins need (runs locked, heads, earlier replies, reducers, positions), decide
in pure code (:class:`~alma_core.joining.JoinPlanner`), write per batch.

* Offsets fenced as for the checkpointer (:mod:`alma_core.storage.offsets`).
* ``joins`` (tenant_id, run_id, join_id) remembers every answer: a join delivered again
  gets the very same reply again (same bytes) and no second checkpoint.
* The reply is an outbox row written with the merged checkpoint, published
  after commit (docs/guarantees.md §3: an ``ok`` reply is only ever sent for a durable
  checkpoint); a reply lost to a crash is published by the outbox sweep.
* An error (missing branch, unknown reducer, strict conflict, too large)
  answers ``status: "error"`` and is dead-lettered with its reason.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg

from alma_core.joining import JoinDecision, JoinPlanner, RunAtJoin
from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerRegistry
from alma_core.schemas.decoder import Rejection
from alma_core.schemas.events import BranchJoin
from alma_core.sequencing import MAIN, CheckpointRow, canonical_json
from alma_core.storage import outbox
from alma_core.storage.batches import RUN_SEQ_HEADER, Batch, BatchStore, Effects, Incoming
from alma_core.storage.cache_entries import cache_entries, consumed_entries
from alma_core.storage.checkpoint_rows import ROWS, rows_args
from alma_core.storage.dead_letters import dead_letter_for
from alma_core.storage.locked import load_locked, lock_runs
from alma_core.storage.outbox import OutboxRow
from alma_core.storage.postgres import columns
from alma_core.types import Checkpoint


@dataclass(frozen=True)
class JoinConfig:
    group_id: str
    consumer: str
    reply_topic: str
    dlq_topic: str
    max_state_bytes: int
    tenant_topics: bool = False  # ALMA_TENANT_TOPICS: the reply topic is the tenant's own


@dataclass
class JoinEffects(Effects):
    """A joiner batch: merges by outcome (ok, error, duplicate, handoff_lost), their times, and the
    merged checkpoints (cached as the runs' new main-line heads)."""

    checkpoints: list[Checkpoint] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    merge_seconds: list[float] = field(default_factory=list)
    decisions: list[JoinDecision] = field(default_factory=list)  # every join, in order

    def span_attributes(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for d in self.decisions:
            attrs: dict[str, Any] = {
                "alma.outcome": _outcome(d),
                "alma.join_id": d.event.payload.join_id,
                # answered before: the orchestrator asked again, or the join was delivered
                # again; the earlier answer is sent again, nothing is merged twice
                "alma.join.answered_before": d.duplicate,
            }
            if d.checkpoint is not None:
                attrs["alma.seq"] = d.checkpoint.seq
            out[d.event.event_id] = attrs
        return out | super().span_attributes()


class PostgresJoinStore(BatchStore[TenantLimits, JoinEffects, None]):
    """``prepared``: the tenants' own limits as last read (their state size limits hold
    for the merged states)."""

    doing = "applying joins"

    def __init__(self, pool: asyncpg.Pool, config: JoinConfig, registry: ReducerRegistry) -> None:
        super().__init__(
            pool, config.group_id, consumer=config.consumer, dlq_topic=config.dlq_topic
        )
        self.config = config
        self.registry = registry

    async def write(
        self,
        conn: asyncpg.Connection,
        cluster_id: str,
        fresh: Batch,
        prepared: TenantLimits,
        reads: None,
    ) -> JoinEffects:
        """Decide each join in partition order (:class:`JoinPlanner`), write the merged
        checkpoints and the answers; the replies go out through the outbox."""
        effects = JoinEffects()
        records = [r for rs in fresh.values() for r in rs]
        joins = [(r, r.decoded) for r in records if isinstance(r.decoded, BranchJoin)]
        planner = await self._load(conn, joins, prepared)
        now = datetime.now(UTC)
        decisions: list[JoinDecision] = []
        merged: list[tuple[str, Checkpoint]] = []  # the state's canonical JSON, the checkpoint
        for record in records:  # completions on this topic are the learner's
            if isinstance(record.decoded, Rejection):
                effects.dead_letters.append(dead_letter_for(record, record.decoded))
            elif isinstance(record.decoded, BranchJoin):
                started = time.perf_counter()
                decision = planner.decide(record.decoded, record.header_int(RUN_SEQ_HEADER))
                if decision.lost:  # handed off again by the checkpointer: nothing to do
                    effects.outcomes[_outcome(decision)] += 1
                    effects.decisions.append(decision)
                    continue
                if not decision.duplicate:
                    effects.merge_seconds.append(time.perf_counter() - started)
                    decisions.append(decision)
                effects.outcomes[_outcome(decision)] += 1
                if decision.rejection is not None:
                    effects.dead_letters.append(dead_letter_for(record, decision.rejection))
                if decision.checkpoint is not None:
                    checkpoint = _checkpoint(decision, now)
                    merged.append((decision.checkpoint.merge.state_json, checkpoint))
                    effects.checkpoints.append(checkpoint)
                    effects.cache_writes += cache_entries({None: checkpoint})
                    effects.cache_writes += consumed_entries(checkpoint, decision.consumed)
                effects.decisions.append(decision)
                effects.outbox.append(self._reply(decision, record))
        await self._write(conn, decisions, planner, merged, now)
        return effects

    # -- loads ----------------------------------------------------------------

    async def _load(
        self,
        conn: asyncpg.Connection,
        joins: list[tuple[Incoming, BranchJoin]],
        limits: TenantLimits,
    ) -> JoinPlanner:
        """Everything the batch's joins need, in four statements whatever their number:
        the runs locked (:mod:`alma_core.storage.locked`), their heads with states and
        their workflows' reducers, the replies given before, the positions' later nodes."""
        keys = {(e.tenant_id, e.run_id) for _, e in joins}
        locked = await lock_runs(conn, keys)
        loaded = await load_locked(
            conn,
            locked,
            with_state=set(locked),
            workflows={(run.tenant_id, run.workflow_id) for run in locked.values()},
        )
        runs = {
            key: RunAtJoin(run.tenant_id, run.workflow_id, run.last_seq, {}, run.pruned)
            for key, run in locked.items()
        }
        for (tenant, run_id, branch), head in loaded.heads.items():
            runs[(tenant, run_id)].heads[branch] = head
        asked = sorted({(e.tenant_id, e.run_id, e.payload.join_id) for _, e in joins})
        replies = {
            (r["tenant_id"], r["run_id"], r["join_id"]): r["reply"]
            for r in await conn.fetch(
                """SELECT j.tenant_id, j.run_id, j.join_id, j.reply FROM joins j
                   JOIN unnest($1::text[], $2::text[], $3::text[]) AS u(t, r, j)
                     ON j.tenant_id = u.t AND j.run_id = u.r AND j.join_id = u.j""",
                *columns(asked, 3),
            )
        }
        positions = sorted(
            {
                (e.tenant_id, e.run_id, p)
                for r, e in joins
                if (p := r.header_int(RUN_SEQ_HEADER)) is not None
            }
        )
        later_node = {
            (r["tenant_id"], r["run_id"], r["position"]): r["later"]
            for r in await conn.fetch(
                """SELECT u.t AS tenant_id, u.r AS run_id, u.p AS position,
                          (SELECT min(seq) FROM checkpoints c
                           WHERE c.tenant_id = u.t AND c.run_id = u.r AND c.seq > u.p
                             AND c.kind <> 'merge') AS later
                   FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(t, r, p)""",
                *columns(positions, 3),
            )
            if r["later"] is not None
        }
        return JoinPlanner(
            runs=runs,
            replies=replies,
            registered=loaded.configs,
            later_node=later_node,
            registry=self.registry,
            max_state_bytes=self.config.max_state_bytes,
            state_limits=limits.state_bytes,
        )

    # -- writes ---------------------------------------------------------------

    async def _write(
        self,
        conn: asyncpg.Connection,
        decisions: list[JoinDecision],
        planner: JoinPlanner,
        merged: list[tuple[str, Checkpoint]],
        now: datetime,
    ) -> None:
        """The batch's merged checkpoints (made ``now``), the runs' main-line heads and seqs, the
        branches they consumed and every answer, in one statement (:data:`_WRITE`)."""
        if not decisions:
            return
        rows = [_row(state_json, cp) for state_json, cp in merged]
        moved = {
            (cp.tenant_id, cp.run_id): planner.runs[(cp.tenant_id, cp.run_id)] for _, cp in merged
        }
        heads = [
            (tenant, run_id, MAIN, run.last_seq, run.heads[MAIN].state_hash)
            for (tenant, run_id), run in moved.items()
        ]
        consumed = [(d.event.tenant_id, d.event.run_id, b) for d in decisions for b in d.consumed]
        answers = [
            (
                d.event.run_id,
                d.event.payload.join_id,
                d.event.tenant_id,
                d.event.event_id,
                d.reply["status"],
                d.reply.get("checkpoint_seq"),
                canonical_json(d.reply),
            )
            for d in decisions
        ]
        await conn.execute(
            _WRITE,
            *rows_args(
                rows,
                now,
                heads,
                [cp.merged_from for _, cp in merged],
            ),
            *columns([(t, r, run.last_seq) for (t, r), run in moved.items()], 3),
            *columns(consumed, 3),
            *columns(answers, 7),
        )

    def _reply(self, decision: JoinDecision, record: Incoming) -> OutboxRow:
        return outbox.join_reply(
            decision.event,
            decision.reply,
            self.config.reply_topic,
            record.trace_headers(),
            per_tenant=self.config.tenant_topics,
        )


# After the rows both writers share (storage/checkpoint_rows.py, $1 to $19): the runs'
# new seqs, the branch heads a join consumed (the next fan-out starts afresh), and every
# answer, remembered for a join delivered again. One round trip per batch.
_WRITE = (
    ROWS
    + """, moved AS (
    UPDATE runs SET last_seq = u.l, updated_at = now()
    FROM unnest($20::text[], $21::text[], $22::bigint[]) AS u(t, r, l)
    WHERE runs.tenant_id = u.t AND runs.run_id = u.r
), consumed AS (
    DELETE FROM run_heads h
    USING unnest($23::text[], $24::text[], $25::text[]) AS u(t, r, b)
    WHERE h.tenant_id = u.t AND h.run_id = u.r AND h.branch_key = u.b
)
INSERT INTO joins (run_id, join_id, tenant_id, event_id, status, checkpoint_seq, reply)
SELECT u.r, u.j, u.t, u.e, u.s, u.c, u.reply::json
FROM unnest($26::text[], $27::text[], $28::text[], $29::text[], $30::text[], $31::bigint[],
            $32::text[]) AS u(r, j, t, e, s, c, reply)
"""
)


def _row(state_json: str, cp: Checkpoint) -> CheckpointRow:
    """A merged checkpoint as the rows' statement takes it."""
    return CheckpointRow(
        run_id=cp.run_id,
        seq=cp.seq,
        tenant_id=cp.tenant_id,
        kind=cp.kind,
        node_id=cp.node_id,
        branch_id=cp.branch_id,
        parent_seq=cp.parent_seq,
        event_id=cp.event_id or "",
        state=cp.state,
        state_json=state_json,
        state_hash=cp.state_hash,
        size_bytes=cp.size_bytes,
        metadata=cp.metadata,
    )


def _outcome(decision: JoinDecision) -> str:
    if decision.lost:
        return "handoff_lost"
    if decision.duplicate:
        return "duplicate"
    return "ok" if decision.checkpoint is not None else "error"


def _checkpoint(decision: JoinDecision, now: datetime) -> Checkpoint:
    merged = decision.checkpoint
    assert merged is not None
    event = decision.event
    return Checkpoint(
        run_id=merged.run_id,
        tenant_id=merged.tenant_id,
        seq=merged.seq,
        state=merged.merge.state,
        state_hash=merged.merge.state_hash,
        size_bytes=merged.merge.size_bytes,
        kind="merge",
        node_id=event.node_id,
        parent_seq=merged.parent_seq,
        event_id=event.event_id,
        merged_from=merged.merge.merged_from,
        metadata={"join_id": event.payload.join_id},
        created_at=now,
    )
