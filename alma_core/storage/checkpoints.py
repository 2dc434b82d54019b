"""PostgresCheckpointStore: one transaction per polled batch (or per group of its
partitions: ``alma_core.consumers.handler.partition_groups``), exactly-once effects.

How a batch becomes effects exactly once, without Kafka transactions:

1. **Offsets in Postgres, fenced** (:mod:`alma_core.storage.offsets`): records already
   applied are dropped, a gap sends the partition back, and a zombie member's
   late writes have no effect.
2. **Inbox.** ``run_events`` is keyed by (tenant, ``event_id``): an event published
   twice (two offsets, one ``event_id``) has its effect once. A run is (tenant,
   ``run_id``) everywhere: two tenants' runs of one id are two runs.
3. **Everything else in the same transaction:** runs, checkpoints, heads,
   the audit log, dead letters, and the outbox rows (hand-offs to the joiner
   and learner, dead-letter records) that are published only after commit.

The caller commits to Kafka after this returns (Postgres first, then Kafka).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg

from alma_core import errors
from alma_core.joining import error_reply
from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerRegistry
from alma_core.schemas.decoder import Decoded, Rejection
from alma_core.schemas.events import (
    BranchJoin,
    Event,
    GraphCheckpoint,
    GraphWrites,
    NodeCompleted,
    NodeFailed,
)
from alma_core.sequencing import (
    CheckpointRow,
    EventRow,
    HeadKey,
    RunKey,
    Sequencer,
    branch_key,
)
from alma_core.storage import graphs, locked, tenant_settings
from alma_core.storage.batches import RUN_SEQ_HEADER, Batch, BatchStore, Effects, Incoming
from alma_core.storage.cache_entries import CacheEntry, cache_entries
from alma_core.storage.checkpoint_rows import ROWS, rows_args
from alma_core.storage.dead_letters import DeadLetter, dead_letter_for, headers_json
from alma_core.storage.effects import CHANNEL, NOTIFY, announce, tokens
from alma_core.storage.offsets import ADVANCE, Fence, advance_args, ends
from alma_core.storage.outbox import OutboxRow, join_reply
from alma_core.types import Checkpoint

# the audit log's mark of an event whose state was given in full (kept in its checkpoint)
STATE_IN_CHECKPOINT = "state_in_checkpoint"


@dataclass
class CheckpointEffects(Effects):
    """A checkpointer batch: the checkpoints written and the events applied, for the
    metrics (the cache entries of the new heads are in ``cache_writes``)."""

    checkpoints: list[CheckpointRow] = field(default_factory=list)
    applied: list[tuple[str, str, datetime]] = field(default_factory=list)  # type, effect, emitted
    duplicates: int = 0  # events whose event_id was recorded before
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    folded: list[EventRow] = field(default_factory=list)  # each new event's effect
    read_again: bool = False  # its first round trip's reads were stale: read once more
    unlisted_outcome = "duplicate"  # a new event with no effect: its event_id was known

    def span_attributes(self) -> dict[str, dict[str, Any]]:
        out = {
            e.event.event_id: {"alma.outcome": e.effect, "alma.run_seq": e.run_seq}
            for e in self.folded
        }
        for row in self.checkpoints:
            out.setdefault(row.event_id, {})["alma.seq"] = row.seq
        return out | super().span_attributes()


@dataclass(frozen=True)
class StoreConfig:
    group_id: str
    consumer: str
    handoff_topic: str
    dlq_topic: str
    max_state_bytes: int
    notify_effects: bool = True  # pg_notify the batch's runs on commit (storage.effects)
    reply_topic: str = "alma.merged.v1"  # a refused join's answer, unless it names one
    tenant_topics: bool = False  # ALMA_TENANT_TOPICS: the reply topic is the tenant's own
    storage_quota: int = 0  # ALMA_TENANT_STORAGE_QUOTA_BYTES: each tenant's, unless its own


def _audit_payload(event: Event) -> str:
    """What the audit log keeps of an event: all but the state (it lives in the
    checkpoint; ``state_in_checkpoint`` says one was given), and of a LangGraph event
    all but its values (in graph_*): the channels it wrote, which the learner and
    ``alma runs`` read."""
    if isinstance(event, GraphCheckpoint):  # the checkpoint itself is in graph_checkpoints
        doc = event.payload.model_dump(
            mode="json", include={"checkpoint_ns", "checkpoint_id", "parent_checkpoint_id"}
        )
        doc["channels"] = sorted(event.payload.values)
        doc["step"] = event.payload.metadata.get("step")
        return json.dumps(doc)
    if isinstance(event, GraphWrites):
        doc = event.payload.model_dump(mode="json", exclude={"writes"}, exclude_none=True)
        doc["channels"] = [w.channel for w in event.payload.writes]
        return json.dumps(doc)
    kept = event.payload.model_dump_json(exclude={"state"}, exclude_none=True)
    if isinstance(event, NodeCompleted | NodeFailed) and event.payload.state is not None:
        # the state was given in full (it is the checkpoint's): replay must take it from
        # there, where a failure without one folds its branch's head
        return f'{kept[:-1]}{"," if len(kept) > 2 else ""}"{STATE_IN_CHECKPOINT}":true}}'
    return kept


def _needs_head_state(event: Decoded) -> bool:
    """An event folded into its branch's head (``updates``, or a failure without state)."""
    return isinstance(event, NodeCompleted | NodeFailed) and event.payload.state is None


def _events(batch: Batch) -> list[Event]:
    """The batch's events (its rejections are dead letters)."""
    return [r.decoded for rs in batch.values() for r in rs if not isinstance(r.decoded, Rejection)]


def _wants(events: list[Event]) -> locked.Wants:
    """What a batch of ``events`` reads: their runs; the head states only of runs whose
    events fold into a head (a branch's first checkpoint takes the main line as its
    parent), and those events' workflows' reducers; every event id, to know it."""
    folds = [e for e in events if _needs_head_state(e)]
    return locked.Wants(
        runs={(e.tenant_id, e.run_id) for e in events},
        with_state={(e.tenant_id, e.run_id) for e in folds},
        workflows={(e.tenant_id, e.workflow_id) for e in folds},
        event_ids={(e.tenant_id, e.event_id) for e in events},
    )


# A batch's writes, one statement: each table's rows from parallel arrays. Sibling
# data-modifying CTEs run on one snapshot; the foreign keys (a new run's checkpoints,
# heads and events) are checked at the end of the statement, when its run row is there.
# A data-modifying CTE runs to completion whether or not the main query reads it; the
# main query names the batch's runs to the effect listeners (delivered on commit), and
# the batch's offsets advance in it too (the batch transaction's last write otherwise).
_WRITE = (
    ROWS
    + """, new_runs AS (
    INSERT INTO runs (run_id, tenant_id, workflow_id, workflow_version, status,
                      last_seq, event_count, completed_at, released_at)
    SELECT u.r, u.t, u.w, u.v, u.s, u.l, u.c, u.d, CASE WHEN u.x THEN $14::timestamptz END
    FROM unnest($20::text[], $21::text[], $22::text[], $23::text[], $24::text[],
                $25::bigint[], $26::bigint[], $27::timestamptz[], $28::boolean[])
         AS u(r, t, w, v, s, l, c, d, x)
    ON CONFLICT (tenant_id, run_id) DO UPDATE SET
      workflow_id = EXCLUDED.workflow_id, status = EXCLUDED.status,
      released_at = CASE WHEN EXCLUDED.released_at IS NOT NULL
                         THEN coalesce(runs.released_at, EXCLUDED.released_at) END,
      last_seq = EXCLUDED.last_seq,
      event_count = EXCLUDED.event_count, completed_at = EXCLUDED.completed_at,
      workflow_version = coalesce(runs.workflow_version, EXCLUDED.workflow_version),
      updated_at = now()
), new_events AS (
    INSERT INTO run_events (event_id, run_id, tenant_id, type, node_id, branch_id,
                            emitted_at, checkpoint_seq, effect, payload, source_topic,
                            source_partition, source_offset)
    SELECT u.i, u.r, u.t, u.y, u.n, u.b, u.at, u.s, u.x, u.p::json, u.st, u.sp, u.so
    FROM unnest($29::text[], $30::text[], $31::text[], $32::text[], $33::text[],
                $34::text[], $35::timestamptz[], $36::bigint[], $37::text[], $38::text[],
                $39::text[], $40::int[], $41::bigint[]) AS u(i, r, t, y, n, b, at, s, x, p,
                                                             st, sp, so)
), advanced AS (
"""
    + ADVANCE.format(topics="$44", partitions="$45", nexts="$46", group="$47", cluster="$48")
    + """
)
"""
    + NOTIFY.format(channel="$42", tokens="$43")
)


class PostgresCheckpointStore(BatchStore[TenantLimits, CheckpointEffects, locked.Reads]):
    """``prepared``: the tenants' own limits as last read (every few seconds): their
    state size limits, and the tenants at their storage quota, of which a batch about to
    refuse a new run reads the standing again first (:meth:`_still_full`), so a quota
    raised, or room freed, is seen at once."""

    def __init__(self, pool: asyncpg.Pool, config: StoreConfig, registry: ReducerRegistry) -> None:
        super().__init__(
            pool, config.group_id, consumer=config.consumer, dlq_topic=config.dlq_topic
        )
        self.config = config
        self.registry = registry

    async def open(
        self, conn: asyncpg.Connection, cluster_id: str, batch: Batch
    ) -> tuple[Fence[Incoming], locked.Reads | None]:
        """The fence, the runs' locks and everything the batch reads of them in one
        round trip (:func:`locked.fence_and_load`): the runs of the whole batch, those
        of records applied before included (their locks cost nothing more)."""
        if not any(batch.values()):
            return await super().open(conn, cluster_id, batch)
        return await locked.fence_and_load(
            conn, self.group_id, cluster_id, batch, _wants(_events(batch))
        )

    async def write(
        self,
        conn: asyncpg.Connection,
        cluster_id: str,
        fresh: Batch,
        prepared: TenantLimits,
        reads: locked.Reads | None,
    ) -> CheckpointEffects:
        """Load what the batch needs (unless :meth:`open` did), fold it in pure code
        (:class:`Sequencer`), write (advancing the offsets in the same statement); see
        the module docstring."""
        events = _events(fresh)
        if reads is None:
            reads = await locked.lock_and_load(conn, _wants(events))
        full = prepared.full
        if full:
            starting = {
                e.tenant_id
                for e in events
                if e.tenant_id in full and (e.tenant_id, e.run_id) not in reads.runs
            }  # tenants of the batch's new runs: read again before refusing one
            full = await self._still_full(conn, starting) if starting else frozenset()
        sequencer = Sequencer(
            runs=reads.runs,
            heads=reads.locked.heads,
            reducer_configs=reads.locked.configs,
            known_event_ids=reads.locked.known,
            registry=self.registry,
            max_state_bytes=self.config.max_state_bytes,
            over_quota=full,
            state_limits=prepared.state_bytes,
        )
        letters: list[DeadLetter] = []
        answers: list[OutboxRow] = []  # refused joins: their callers wait for a reply
        for records in fresh.values():
            for record in records:
                decoded = record.decoded
                if isinstance(decoded, Rejection):
                    letters.append(dead_letter_for(record, decoded))
                    continue
                try:
                    sequencer.fold(decoded, record.coords)
                except errors.RejectedEvent as exc:
                    letters.append(dead_letter_for(record, exc))
                    if isinstance(decoded, BranchJoin):
                        answer = error_reply(decoded, exc)
                        trace = record.trace_headers()
                        answers.append(
                            join_reply(
                                decoded,
                                answer,
                                self.config.reply_topic,
                                trace,
                                per_tenant=self.config.tenant_topics,
                            )
                        )
        effects = sequencer.effects
        created_at = datetime.now(UTC)
        heads: dict[HeadKey, CheckpointRow] = {}
        for row in effects.checkpoints:
            heads[(row.tenant_id, row.run_id, branch_key(row.branch_id))] = row
        touched = [(e.tenant_id, e.run_id) for e in events] + [
            (d.tenant_id, d.run_id) for d in letters if d.tenant_id and d.run_id
        ]
        notify = tokens(touched) if self.config.notify_effects else []
        advance = advance_args(self.group_id, cluster_id, ends(fresh))
        written = await self._write(conn, sequencer, created_at, heads, notify, advance)
        if not written and notify:
            await announce(conn, touched)  # dead letters only: nothing written
        return CheckpointEffects(
            dead_letters=letters,
            outbox=self._handoffs(sequencer, fresh) + answers,
            cache_writes=_cache_entries(heads.values(), created_at),
            offsets_stored=written,
            checkpoints=effects.checkpoints,
            applied=[(e.event.type, e.effect, e.event.emitted_at) for e in effects.events],
            duplicates=effects.duplicates,
            created_at=created_at,
            folded=effects.events,
            read_again=reads.read_again,
        )

    async def _still_full(self, conn: asyncpg.Connection, tenants: set[str]) -> frozenset[str]:
        """Which of ``tenants`` (at their quota when last read) are at it now."""
        standings = await tenant_settings.storage(conn, self.config.storage_quota, tenants)
        return frozenset(s.tenant_id for s in standings if s.full)

    # -- writes ---------------------------------------------------------------

    async def _write(
        self,
        conn: asyncpg.Connection,
        seq: Sequencer,
        created_at: datetime,
        heads: dict[HeadKey, CheckpointRow],
        notify: list[str],
        advance: tuple[list[str], list[int], list[int], str, str],
    ) -> bool:
        """The batch's runs, checkpoints, heads and audit rows, the notifications of
        ``notify`` and the offsets' ``advance`` (:func:`offsets.advance_args`) in one
        statement (one round trip, one execution per table rather than one per row),
        then its LangGraph rows. False when there was nothing to write (and so nobody
        was notified, and the offsets are still to advance)."""
        runs = [r for r in seq.runs.values() if r.changed]
        cps = seq.effects.checkpoints
        events = seq.effects.events
        written = bool(runs or cps or events)
        if written:
            await conn.execute(
                _WRITE,
                *rows_args(
                    cps,
                    created_at,
                    [(*key, row.seq, row.state_hash) for key, row in heads.items()],
                ),
                [r.run_id for r in runs],
                [r.tenant_id for r in runs],
                [r.workflow_id for r in runs],
                [r.workflow_version for r in runs],
                [r.status for r in runs],
                [r.last_seq for r in runs],
                [r.event_count for r in runs],
                [r.completed_at for r in runs],
                [r.released for r in runs],
                [e.event.event_id for e in events],
                [e.event.run_id for e in events],
                [e.event.tenant_id for e in events],
                [e.event.type for e in events],
                [e.event.node_id for e in events],
                [e.event.branch_id for e in events],
                [e.event.emitted_at for e in events],
                [e.checkpoint_seq for e in events],
                [e.effect for e in events],
                [_audit_payload(e.event) for e in events],
                [e.coords.topic for e in events],
                [e.coords.partition for e in events],
                [e.coords.offset for e in events],
                CHANNEL,
                notify,
                *advance,
            )
        await graphs.insert(conn, seq.effects.graph)
        return written

    def _handoffs(self, seq: Sequencer, fresh: Batch) -> list[OutboxRow]:
        """Joins and completions for the joiner and the learner, once durable, each with
        its event's trace context (that of the event's span in a traced worker)."""
        outbox: list[OutboxRow] = []
        traces = {r.coords: t for rs in fresh.values() for r in rs if (t := r.trace_headers())}
        for row in seq.effects.handoffs:
            # Hand-offs carry the event as decoded: canonical JSON of the contract.
            record_value = row.event.model_dump_json(exclude_none=True).encode()
            outbox.append(
                (
                    self.config.handoff_topic,
                    row.event.run_id.encode(),
                    record_value,
                    headers_json(
                        {
                            "alma.event_type": row.event.type,
                            "alma.event_id": row.event.event_id,
                            RUN_SEQ_HEADER: row.run_seq,
                            "alma.source.topic": row.coords.topic,
                            "alma.source.partition": row.coords.partition,
                            "alma.source.offset": row.coords.offset,
                            **traces.get(row.coords, {}),
                        }
                    ),
                )
            )
        return outbox


def _cache_entries(rows: Iterable[CheckpointRow], created_at: datetime) -> list[CacheEntry]:
    """Cache entries for the new branch heads of a batch, run by run (a run is its
    tenant's: two tenants' runs of one id are two runs, each with its own ``latest``)."""
    by_run: dict[RunKey, dict[str | None, Checkpoint]] = {}
    texts: dict[RunKey, dict[str | None, str]] = {}
    for row in rows:
        run = (row.tenant_id, row.run_id)
        texts.setdefault(run, {})[row.branch_id] = row.state_json
        by_run.setdefault(run, {})[row.branch_id] = Checkpoint(
            run_id=row.run_id,
            tenant_id=row.tenant_id,
            seq=row.seq,
            state=row.state,
            state_hash=row.state_hash,
            size_bytes=row.size_bytes,
            kind=row.kind,
            node_id=row.node_id,
            branch_id=row.branch_id,
            parent_seq=row.parent_seq,
            event_id=row.event_id,
            metadata=row.metadata,
            created_at=created_at,
        )
    return [e for run, heads in by_run.items() for e in cache_entries(heads, texts[run])]
