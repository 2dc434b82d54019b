"""PostgresCheckpointStore: one transaction per polled batch, exactly-once effects.

How a batch becomes effects exactly once, without Kafka transactions:

1. **Offsets in Postgres, fenced** (:mod:`alma_core.storage.offsets`): records already
   applied are dropped, a gap sends the partition back, and a zombie member's
   late writes have no effect.
2. **Inbox.** ``run_events.event_id`` is the primary key: an event published
   twice (two offsets, one ``event_id``) has its effect once.
3. **Everything else in the same transaction:** runs, checkpoints, heads,
   the audit log, dead letters, and the outbox rows (hand-offs to the joiner
   and learner, dead-letter records) that are published only after commit.

The caller commits to Kafka after this returns (Postgres first, then Kafka).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import asyncpg

from alma_core import errors
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.sequencing import (
    CheckpointRow,
    Head,
    RunView,
    Sequencer,
    branch_key,
)
from alma_core.storage import offsets
from alma_core.storage.batches import (
    RUN_SEQ_HEADER,
    BatchStore,
    DeadLetter,
    Incoming,
    OutboxRow,
    dead_letter_for,
    headers_json,
    insert_outbox,
    record_dead_letter,
)
from alma_core.storage.offsets import TopicPartition
from schemas.decoder import Decoded, Rejection
from schemas.events import Event, NodeCompleted, NodeFailed


@dataclass
class BatchResult:
    checkpoints: list[CheckpointRow] = field(default_factory=list)
    heads: dict[tuple[str, str], CheckpointRow] = field(default_factory=dict)
    outbox_ids: list[int] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    seeks: dict[TopicPartition, int] = field(default_factory=dict)
    next_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    effects: Counter[str] = field(default_factory=Counter)
    applied: list[tuple[str, str, datetime]] = field(default_factory=list)  # type, effect, emitted
    duplicates: int = 0
    already_applied: int = 0
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))


@dataclass(frozen=True)
class StoreConfig:
    group_id: str
    consumer: str
    handoff_topic: str
    dlq_topic: str
    max_state_bytes: int


def _audit_payload(event: Event) -> str:
    # The state itself lives in the checkpoint; the log keeps everything else.
    return event.payload.model_dump_json(exclude={"state"}, exclude_none=True)


def _needs_head_state(event: Decoded) -> tuple[str, str] | None:
    if isinstance(event, NodeCompleted | NodeFailed) and event.payload.state is None:
        return (event.run_id, branch_key(event.branch_id))
    return None


class PostgresCheckpointStore(BatchStore):
    def __init__(self, pool: asyncpg.Pool, config: StoreConfig, registry: ReducerRegistry) -> None:
        super().__init__(pool, config.group_id, dlq_topic=config.dlq_topic)
        self.config = config
        self.registry = registry

    async def apply(
        self, cluster_id: str, batch: dict[TopicPartition, list[Incoming]]
    ) -> BatchResult:
        """Apply a polled batch in one transaction; see the module docstring."""
        return await self.in_transaction(
            "applying a batch", lambda conn: self._apply(conn, cluster_id, batch)
        )

    async def _apply(
        self,
        conn: asyncpg.Connection,
        cluster_id: str,
        batch: dict[TopicPartition, list[Incoming]],
    ) -> BatchResult:
        result = BatchResult()
        fenced = await offsets.fence(conn, self.config.group_id, cluster_id, batch)
        result.seeks, result.next_offsets = fenced.seeks, fenced.next_offsets
        result.already_applied = fenced.already_applied
        todo = fenced.todo
        if not todo:
            return result
        events = [
            r.decoded for rs in todo.values() for r in rs if not isinstance(r.decoded, Rejection)
        ]
        sequencer = Sequencer(
            runs=await self._load_runs(conn, sorted({e.run_id for e in events})),
            heads=await self._load_heads(conn, events),
            reducer_configs=await self._load_reducer_configs(conn, events),
            known_event_ids=await self._known_event_ids(conn, [e.event_id for e in events]),
            registry=self.registry,
            max_state_bytes=self.config.max_state_bytes,
        )
        for records in todo.values():
            for record in records:
                decoded = record.decoded
                if isinstance(decoded, Rejection):
                    result.dead_letters.append(dead_letter_for(record, decoded))
                    continue
                try:
                    effect = sequencer.apply(decoded, record.coords)
                except errors.RejectedEvent as exc:
                    result.dead_letters.append(dead_letter_for(record, exc))
                    continue
                result.effects[effect or "duplicate"] += 1
        effects = sequencer.effects
        result.applied = [(e.event.type, e.effect, e.event.emitted_at) for e in effects.events]
        result.duplicates = effects.duplicates
        result.checkpoints = effects.checkpoints
        for row in effects.checkpoints:
            result.heads[(row.run_id, branch_key(row.branch_id))] = row
        await self._write(conn, sequencer, result)
        ends = await offsets.advance(conn, self.config.group_id, cluster_id, todo)
        result.next_offsets.update(ends)
        return result

    # -- loads ----------------------------------------------------------------

    async def _load_runs(self, conn: asyncpg.Connection, run_ids: list[str]) -> dict[str, RunView]:
        rows = await conn.fetch(
            """SELECT run_id, tenant_id, workflow_id, workflow_version, status, last_seq,
                      event_count, completed_at
               FROM runs WHERE run_id = ANY($1::text[]) ORDER BY run_id FOR UPDATE""",
            run_ids,
        )
        return {r["run_id"]: RunView(**dict(r)) for r in rows}

    async def _load_heads(
        self, conn: asyncpg.Connection, events: list[Event]
    ) -> dict[tuple[str, str], Head]:
        run_ids = sorted({e.run_id for e in events})
        need_state = {k for k in map(_needs_head_state, events) if k is not None}
        # A branch's first checkpoint takes the main line as its parent.
        need_state_runs = sorted({run for run, _ in need_state})
        rows = await conn.fetch(
            """SELECT h.run_id, h.branch_key, h.seq, h.state_hash,
                      CASE WHEN h.run_id = ANY($2::text[]) THEN c.state END AS state
               FROM run_heads h
               LEFT JOIN checkpoints c ON c.run_id = h.run_id AND c.seq = h.seq
                                      AND h.run_id = ANY($2::text[])
               WHERE h.run_id = ANY($1::text[])""",
            run_ids,
            need_state_runs,
        )
        return {
            (r["run_id"], r["branch_key"]): Head(r["seq"], r["state_hash"], r["state"] or {})
            for r in rows
        }

    async def _load_reducer_configs(
        self, conn: asyncpg.Connection, events: list[Event]
    ) -> dict[tuple[str, str], ReducerConfig]:
        pairs = sorted({(e.tenant_id, e.workflow_id) for e in events if _needs_head_state(e)})
        if not pairs:
            return {}
        rows = await conn.fetch(
            """SELECT tenant_id, workflow_id, config FROM reducer_configs
               WHERE (tenant_id, workflow_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))""",
            [t for t, _ in pairs],
            [w for _, w in pairs],
        )
        return {
            (r["tenant_id"], r["workflow_id"]): ReducerConfig.from_json(r["config"]) for r in rows
        }

    async def _known_event_ids(self, conn: asyncpg.Connection, event_ids: list[str]) -> set[str]:
        rows = await conn.fetch(
            "SELECT event_id FROM run_events WHERE event_id = ANY($1::text[])", event_ids
        )
        return {r["event_id"] for r in rows}

    # -- writes ---------------------------------------------------------------

    async def _write(self, conn: asyncpg.Connection, seq: Sequencer, result: BatchResult) -> None:
        changed = [r for r in seq.runs.values() if r.changed]
        if changed:
            await conn.executemany(
                """INSERT INTO runs (run_id, tenant_id, workflow_id, workflow_version, status,
                                     last_seq, event_count, completed_at)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                   ON CONFLICT (run_id) DO UPDATE SET
                     status = EXCLUDED.status, last_seq = EXCLUDED.last_seq,
                     event_count = EXCLUDED.event_count, completed_at = EXCLUDED.completed_at,
                     workflow_version = coalesce(runs.workflow_version, EXCLUDED.workflow_version),
                     updated_at = now()""",
                [
                    (r.run_id, r.tenant_id, r.workflow_id, r.workflow_version, r.status,
                     r.last_seq, r.event_count, r.completed_at)
                    for r in changed
                ],
            )  # fmt: skip
        if result.checkpoints:
            await conn.executemany(
                """INSERT INTO checkpoints (run_id, seq, tenant_id, kind, node_id, branch_id,
                       parent_seq, event_id, state, state_hash, size_bytes, metadata, created_at)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12::jsonb, $13)""",
                [
                    (c.run_id, c.seq, c.tenant_id, c.kind, c.node_id, c.branch_id, c.parent_seq,
                     c.event_id, c.state_json, c.state_hash, c.size_bytes, c.metadata,
                     result.created_at)
                    for c in result.checkpoints
                ],
            )  # fmt: skip
            await conn.executemany(
                """INSERT INTO run_heads (run_id, branch_key, seq, state_hash)
                   VALUES ($1, $2, $3, $4)
                   ON CONFLICT (run_id, branch_key) DO UPDATE
                   SET seq = EXCLUDED.seq, state_hash = EXCLUDED.state_hash""",
                [(run, key, row.seq, row.state_hash) for (run, key), row in result.heads.items()],
            )
        events = seq.effects.events
        if events:
            await conn.executemany(
                """INSERT INTO run_events (event_id, run_id, tenant_id, type, node_id, branch_id,
                       emitted_at, checkpoint_seq, effect, payload, source_topic,
                       source_partition, source_offset)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11, $12, $13)""",
                [
                    (e.event.event_id, e.event.run_id, e.event.tenant_id, e.event.type,
                     e.event.node_id, e.event.branch_id, e.event.emitted_at, e.checkpoint_seq,
                     e.effect, _audit_payload(e.event), e.coords.topic, e.coords.partition,
                     e.coords.offset)
                    for e in events
                ],
            )  # fmt: skip
        outbox: list[OutboxRow] = []
        for row in seq.effects.handoffs:
            # Hand-offs carry the event as decoded: canonical JSON of the contract.
            record_value = row.event.model_dump_json(exclude_none=True).encode()
            outbox.append((
                self.config.handoff_topic, row.event.run_id.encode(), record_value,
                headers_json({"alma.event_type": row.event.type,
                              "alma.event_id": row.event.event_id,
                              RUN_SEQ_HEADER: row.run_seq,
                              "alma.source.topic": row.coords.topic,
                              "alma.source.partition": row.coords.partition,
                              "alma.source.offset": row.coords.offset}),
            ))  # fmt: skip
        for dl in result.dead_letters:
            outbox.append(
                await record_dead_letter(conn, self.config.consumer, self.config.dlq_topic, dl)
            )
        result.outbox_ids = await insert_outbox(conn, outbox)
