"""PostgresCheckpointStore: one transaction per polled batch, exactly-once effects.

How a batch becomes effects exactly once, without Kafka transactions:

1. **Offsets in Postgres, fenced** (:mod:`alma_core.offsets`): records already
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

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import asyncpg

from alma_core import errors, offsets
from alma_core.offsets import TopicPartition
from alma_core.postgres import is_storage_failure, storage_error
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.sequencing import (
    CheckpointRow,
    Coordinates,
    Head,
    RunView,
    Sequencer,
    branch_key,
)
from schemas.decoder import Decoded, Rejection
from schemas.events import Event, NodeCompleted, NodeFailed


@dataclass(frozen=True)
class Incoming:
    """One consumed record with its decoding."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    decoded: Decoded

    @property
    def coords(self) -> Coordinates:
        return Coordinates(self.topic, self.partition, self.offset)


@dataclass(frozen=True)
class DeadLetter:
    record: Incoming
    reason: str
    detail: str
    event_id: str | None
    run_id: str | None
    tenant_id: str | None


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


def _headers(pairs: dict[str, str | int | None]) -> str:
    return json.dumps([[k, str(v)] for k, v in pairs.items() if v is not None])


def dead_letter_for(record: Incoming, exc: errors.AlmaError | Rejection) -> DeadLetter:
    if isinstance(exc, Rejection):
        return DeadLetter(
            record, exc.reason.value, exc.describe(), exc.event_id, exc.run_id, exc.tenant_id
        )
    event = record.decoded
    assert not isinstance(event, Rejection)
    return DeadLetter(
        record, exc.reason, exc.message, event.event_id, event.run_id, event.tenant_id
    )


def _audit_payload(event: Event) -> str:
    # The state itself lives in the checkpoint; the log keeps everything else.
    return event.payload.model_dump_json(exclude={"state"}, exclude_none=True)


def _needs_head_state(event: Decoded) -> tuple[str, str] | None:
    if isinstance(event, NodeCompleted | NodeFailed) and event.payload.state is None:
        return (event.run_id, branch_key(event.branch_id))
    return None


class PostgresCheckpointStore:
    def __init__(self, pool: asyncpg.Pool, config: StoreConfig, registry: ReducerRegistry) -> None:
        self.pool = pool
        self.config = config
        self.registry = registry

    async def stored_offsets(
        self, cluster_id: str, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        """Where each partition resumes, for this group on this broker cluster."""
        try:
            return await offsets.stored_offsets(
                self.pool, self.config.group_id, cluster_id, partitions
            )
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, "reading stored offsets") from exc
            raise

    async def apply(
        self, cluster_id: str, batch: dict[TopicPartition, list[Incoming]]
    ) -> BatchResult:
        """Apply a polled batch in one transaction; see the module docstring."""
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                return await self._apply(conn, cluster_id, batch)
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, "applying a batch") from exc
            raise

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
        outbox: list[tuple[str, bytes | None, bytes, str]] = []
        for row in seq.effects.handoffs:
            # Hand-offs carry the event as decoded: canonical JSON of the contract.
            record_value = row.event.model_dump_json(exclude_none=True).encode()
            outbox.append((
                self.config.handoff_topic, row.event.run_id.encode(), record_value,
                _headers({"alma.event_type": row.event.type, "alma.event_id": row.event.event_id,
                          "alma.source.topic": row.coords.topic,
                          "alma.source.partition": row.coords.partition,
                          "alma.source.offset": row.coords.offset}),
            ))  # fmt: skip
        for dl in result.dead_letters:
            rec = dl.record
            await conn.execute(
                """INSERT INTO dead_letters (consumer, reason, detail, event_id, run_id, tenant_id,
                       source_topic, source_partition, source_offset, key, value)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
                   ON CONFLICT DO NOTHING""",
                self.config.consumer, dl.reason, dl.detail, dl.event_id, dl.run_id, dl.tenant_id,
                rec.topic, rec.partition, rec.offset, rec.key, rec.value,
            )  # fmt: skip
            outbox.append((
                self.config.dlq_topic, rec.key, rec.value or b"",
                _headers({"alma.reason": dl.reason, "alma.detail": dl.detail[:1000],
                          "alma.consumer": self.config.consumer, "alma.source.topic": rec.topic,
                          "alma.source.partition": rec.partition,
                          "alma.source.offset": rec.offset}),
            ))  # fmt: skip
        if outbox:
            rows = await conn.fetch(
                """INSERT INTO outbox (topic, key, value, headers)
                   SELECT * FROM unnest($1::text[], $2::bytea[], $3::bytea[], $4::jsonb[])
                   RETURNING id""",
                [o[0] for o in outbox],
                [o[1] for o in outbox],
                [o[2] for o in outbox],
                [o[3] for o in outbox],
            )
            result.outbox_ids = [r["id"] for r in rows]
