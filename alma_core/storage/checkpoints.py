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

The transaction is one statement where it can be (:meth:`PostgresCheckpointStore.
transact`): the batch read without locks, or folded from the checkpointer's memory of
its own writes (:mod:`alma_core.storage.run_memory`), is written by ``_WRITE``, which
checks what was read and commits alone; a batch whose check fails is applied again
under the runs' locks, in a transaction of its own.

The caller commits to Kafka after this returns (Postgres first, then Kafka).
"""

from __future__ import annotations

import functools
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
    RunView,
    Sequencer,
    branch_key,
)
from alma_core.storage import graphs, locked, offsets, tenant_settings
from alma_core.storage.batches import (
    RUN_SEQ_HEADER,
    Batch,
    BatchStore,
    Committed,
    Effects,
    Incoming,
)
from alma_core.storage.cache_entries import CacheEntry, cache_entries
from alma_core.storage.checkpoint_rows import ROWS, rows_args
from alma_core.storage.dead_letters import DeadLetter, dead_letter_for, headers_json
from alma_core.storage.effects import CHANNEL, NOTIFY, announce, tokens
from alma_core.storage.offsets import ADVANCE, Fence, PartitionKey, advance_args, ends
from alma_core.storage.outbox import OutboxRow, join_reply
from alma_core.storage.postgres import columns, is_storage_failure, storage_error
from alma_core.storage.run_memory import Recalled, RunMemory, WorkflowKey
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
    unlocked: bool = False  # read without locks, written by one checked statement
    recalled: bool = False  # folded from the checkpointer's memory: no read at all
    # under the locks: the batch as folded and its runs' new row versions, for memory
    plan: _Plan | None = field(default=None, repr=False)
    versions: dict[RunKey, str] = field(default_factory=dict, repr=False)
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
class _Checks:
    """What a batch read without locks checks in its write statement (``_WRITE``'s
    ``verdict``): each fresh partition's stored next offset, in the order of the
    advance's partitions; each run written that existed, with its row version; each run
    written that did not."""

    offsets: list[int] = field(default_factory=list)
    runs: list[tuple[str, str, str]] = field(default_factory=list)  # tenant, run, version
    new: list[RunKey] = field(default_factory=list)
    # a batch folded from memory: its workflows' reducers (tenant, workflow, version)
    configs: list[tuple[str, str, str | None]] = field(default_factory=list)
    # the heads of the runs in ``runs`` as read: tenant, run, branch key, seq, hash
    heads: list[tuple[str, str, str, int, str]] = field(default_factory=list)

    def args(self) -> list[Any]:
        """``_WRITE``'s $49 to $62."""
        return [
            [t for t, _, _ in self.runs],
            [r for _, r, _ in self.runs],
            [v for _, _, v in self.runs],
            self.offsets,
            [t for t, _ in self.new],
            [r for _, r in self.new],
            [t for t, _, _ in self.configs],
            [w for _, w, _ in self.configs],
            [v for _, _, v in self.configs],
            *columns(self.heads, 5),
        ]


_NO_CHECKS = _Checks()  # a batch under the runs' locks


@dataclass
class _Plan:
    """A batch folded, before its write: the sequencer's effects, its dead letters and
    outbox rows, the new heads, the runs to notify, the offsets' advance."""

    sequencer: Sequencer
    letters: list[DeadLetter]
    outbox: list[OutboxRow]
    heads: dict[HeadKey, CheckpointRow]
    touched: list[RunKey]
    notify: list[str]
    advance: tuple[list[str], list[int], list[int], str, str]
    created_at: datetime
    existing: frozenset[RunKey]  # the runs that had a row when the batch read them
    heads_read: dict[HeadKey, tuple[int, str]]  # seq and hash, before the fold's
    reads: locked.Reads
    wants: locked.Wants

    @functools.cached_property
    def runs_written(self) -> list[RunView]:
        """The runs the fold changed, in the runs' lock order (tenant, run id); the fold
        is over when a plan is made."""
        changed = (r for r in self.sequencer.runs.values() if r.changed)
        return sorted(changed, key=lambda r: (r.tenant_id, r.run_id))

    @property
    def writes_runs(self) -> bool:
        """Whether the batch writes anything of its runs (else at most dead letters)."""
        effects = self.sequencer.effects
        return bool(effects.checkpoints or effects.events or self.runs_written)

    def checks(
        self,
        stored: dict[PartitionKey, int],
        configs: dict[WorkflowKey, str | None] | None = None,
    ) -> _Checks:
        """What the write must find unchanged of what the batch read: the partitions'
        ``stored`` offsets, its runs' row versions, and (folded from memory) its
        workflows' reducers' ``configs``."""
        topics, partitions = self.advance[0], self.advance[1]
        versions = self.reads.versions
        runs = self.runs_written
        checked = {r.key for r in runs if r.key in versions}
        return _Checks(
            offsets=[stored[tp] for tp in zip(topics, partitions, strict=True)],
            runs=[(*r.key, versions[r.key]) for r in runs if r.key in versions],
            new=[r.key for r in runs if r.key not in versions],
            configs=[(*wf, v) for wf, v in sorted((configs or {}).items())],
            heads=[
                (t, r, b, seq, digest)
                for (t, r, b), (seq, digest) in self.heads_read.items()
                if (t, r) in checked
            ],
        )

    def remember(self, memory: RunMemory, versions: dict[RunKey, str], recalled: bool) -> None:
        """Once the batch committed: what it wrote, into the checkpointer's memory."""
        wants = self.wants
        states_known = (
            wants.with_state
            | {r.key for r in self.runs_written if r.key not in self.existing}
            | self.reads.states_known
        )
        configs = {
            wf: (self.reads.locked.configs.get(wf), self.reads.locked.config_versions.get(wf))
            for wf in wants.workflows
        }
        topics, partitions, nexts = self.advance[:3]
        memory.remember(
            dict(zip(zip(topics, partitions, strict=True), nexts, strict=True)),
            [(r, versions[r.key]) for r in self.runs_written if r.key in versions],
            self.reads.locked.heads,
            self.heads,
            states_known,
            configs,
            recalled=recalled,
        )


def _redo_locked(exc: BaseException) -> bool:
    """Whether an unlocked batch's failure sends it to the locked path: its check found
    a change (or its write met one: a key another batch took, a deadlock), or
    PostgreSQL refused the statement for its data (the locked path meets the same
    refusal, and the handler isolates the record). Not when PostgreSQL is unavailable:
    that is the runtime's to retry."""
    if isinstance(exc, _MET_A_CHANGE):
        return True
    return isinstance(exc, asyncpg.PostgresError) and not storage_error(exc, "").retriable


_MET_A_CHANGE = (
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.IntegrityConstraintViolationError,
)


def _reads(recalled: Recalled) -> locked.Reads:
    """What a batch folded from memory reads: memory's runs, heads and reducers, no
    event id (a known one fails the write, and the batch is read again)."""
    return locked.Reads(
        recalled.runs,
        locked.Locked(
            recalled.heads,
            recalled.configs,
            {},
            {wf: v for wf, v in recalled.config_versions.items() if v is not None},
        ),
        versions=recalled.versions,
        states_known=frozenset(recalled.states_known),
    )


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
    unlocked_reads: bool = True  # ALMA_UNLOCKED_READS: read without locks, write checked
    memory_bytes: int = 0  # ALMA_RUN_MEMORY_BYTES: fold from memory of its writes (0: off)


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
#
# A batch read without locks (:meth:`PostgresCheckpointStore._unlocked`) is checked in
# the same statement: ``verdict``, which the main query evaluates first and the runs' and
# offsets' writes wait for, locks each partition's offset row and each run row read, in
# the locked path's order, where they still hold what was read ($52: the stored next
# offsets; $49-$51: each run's row version; READ COMMITTED re-checks a row another
# transaction changed once it commits) and finds those runs' heads as read ($58-$62:
# every writer of a run's heads updates its row too; this holds without that), and the
# main query checks that every run read as new ($53-$54) was inserted, not found;
# otherwise ``alma_stale`` fails the statement, so nothing of it is written. A batch
# folded from the checkpointer's memory
# (:mod:`alma_core.storage.run_memory`) checks its workflows' reducers too ($55-$57:
# each one's row version, or NULL where it had none), on the statement's snapshot as
# a read would see them. A batch under the locks passes empty lists: no check. The main
# query returns each run's new row version, for that memory.
_WRITE = (
    ROWS
    + """, checked_offsets AS (
    SELECT 1 FROM consumer_offsets o
    JOIN unnest($44::text[], $45::int[], $52::bigint[]) AS u(t, p, e)
      ON o.topic = u.t AND o.partition = u.p
    WHERE o.group_id = $47 AND o.cluster_id = $48 AND o.next_offset = u.e
    ORDER BY o.topic, o.partition FOR UPDATE OF o
), checked_runs AS (
    SELECT 1 FROM runs r JOIN unnest($49::text[], $50::text[], $51::text[]) AS u(t, r, v)
      ON r.tenant_id = u.t AND r.run_id = u.r
    WHERE r.xmin::text = u.v
    ORDER BY r.tenant_id, r.run_id FOR UPDATE OF r
), checked_configs AS (
    SELECT 1 FROM unnest($55::text[], $56::text[], $57::text[]) AS u(t, w, v)
    WHERE CASE WHEN u.v IS NULL
               THEN NOT EXISTS (SELECT 1 FROM reducer_configs rc
                                WHERE rc.tenant_id = u.t AND rc.workflow_id = u.w)
               ELSE EXISTS (SELECT 1 FROM reducer_configs rc
                            WHERE rc.tenant_id = u.t AND rc.workflow_id = u.w
                              AND rc.xmin::text = u.v) END
), checked_heads AS (
    SELECT count(*) FILTER (WHERE e.t IS NOT NULL) AS same, count(*) AS found
    FROM run_heads h JOIN unnest($49::text[], $50::text[]) AS u(t, r)
      ON h.tenant_id = u.t AND h.run_id = u.r
    LEFT JOIN unnest($58::text[], $59::text[], $60::text[], $61::bigint[], $62::text[])
           AS e(t, r, b, s, x)
      ON e.t = h.tenant_id AND e.r = h.run_id AND e.b = h.branch_key AND e.s = h.seq
     AND e.x = h.state_hash
), verdict AS (
    SELECT CASE
      WHEN cardinality($52::bigint[]) = 0 AND cardinality($51::text[]) = 0
           AND cardinality($55::text[]) = 0 THEN true
      WHEN (SELECT count(*) FROM checked_offsets) <> cardinality($52::bigint[])
        THEN alma_stale('a partition''s stored offset')
      WHEN (SELECT count(*) FROM checked_runs) <> cardinality($51::text[])
        THEN alma_stale('a run')
      WHEN (SELECT count(*) FROM checked_configs) <> cardinality($55::text[])
        THEN alma_stale('a workflow''s reducers')
      WHEN (SELECT same <> found OR found <> cardinality($58::text[]) FROM checked_heads)
        THEN alma_stale('a run''s heads')
      ELSE true END AS ok
), new_runs AS (
    INSERT INTO runs (run_id, tenant_id, workflow_id, workflow_version, status,
                      last_seq, event_count, completed_at, released_at)
    SELECT u.r, u.t, u.w, u.v, u.s, u.l, u.c, u.d, CASE WHEN u.x THEN $14::timestamptz END
    FROM unnest($20::text[], $21::text[], $22::text[], $23::text[], $24::text[],
                $25::bigint[], $26::bigint[], $27::timestamptz[], $28::boolean[])
         AS u(r, t, w, v, s, l, c, d, x)
    WHERE (SELECT ok FROM verdict)
    ON CONFLICT (tenant_id, run_id) DO UPDATE SET
      workflow_id = EXCLUDED.workflow_id, status = EXCLUDED.status,
      released_at = CASE WHEN EXCLUDED.released_at IS NOT NULL
                         THEN coalesce(runs.released_at, EXCLUDED.released_at) END,
      last_seq = EXCLUDED.last_seq,
      event_count = EXCLUDED.event_count, completed_at = EXCLUDED.completed_at,
      workflow_version = coalesce(runs.workflow_version, EXCLUDED.workflow_version),
      updated_at = now()
    RETURNING runs.tenant_id, runs.run_id, xmax = 0 AS inserted, runs.xmin::text AS version
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
      AND (SELECT ok FROM verdict)
)
SELECT (SELECT ok FROM verdict) AS ok,
       (SELECT count(*) FROM ("""
    + NOTIFY.format(channel="$42", tokens="$43")
    + """) AS n) AS notified,
       (SELECT CASE WHEN EXISTS (
                  SELECT 1 FROM new_runs n JOIN unnest($53::text[], $54::text[]) AS u(t, r)
                    ON n.tenant_id = u.t AND n.run_id = u.r
                  WHERE NOT n.inserted)
               THEN alma_stale('a run read as new (another batch created it)')
               ELSE true END) AS created,
       (SELECT coalesce(json_agg(json_build_array(n.tenant_id, n.run_id, n.version)), '[]')
        FROM new_runs n) AS versions
"""
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
        self.memory = (
            RunMemory(config.memory_bytes)
            if config.unlocked_reads and config.memory_bytes > 0
            else None
        )

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

    async def transact(
        self, cluster_id: str, batch: Batch, prepared: TenantLimits
    ) -> Committed[CheckpointEffects]:
        """The batch read without locks (or folded from memory) and written in one
        statement that commits alone and checks what was read (:meth:`_unlocked`,
        ``StoreConfig.unlocked_reads``); in a transaction under the runs' locks (the
        base's) where that declines, or where its check finds a run, an offset or a
        workflow's reducers changed since the read (then the effects say
        ``read_again``, and memory forgets the batch's runs and partitions)."""
        stale = False
        if self.config.unlocked_reads and any(batch.values()):
            try:
                done = await self._unlocked(cluster_id, batch, prepared)
            except Exception as exc:
                if not _redo_locked(exc):
                    if is_storage_failure(exc):
                        raise storage_error(exc, self.doing) from exc
                    raise
                stale = True
                if self.memory is not None:
                    self.memory.forget(_wants(_events(batch)).runs, batch)
            else:
                if done is not None:
                    return done
        committed = await super().transact(cluster_id, batch, prepared)
        effects = committed.effects
        if effects is not None:
            effects.read_again = effects.read_again or stale
            if self.memory is not None and effects.plan is not None:
                effects.plan.remember(self.memory, effects.versions, recalled=False)
        return committed

    async def assigned(self, partitions: list[PartitionKey]) -> None:
        """Partitions newly assigned here: what memory holds may be another member's
        past (its writes were checked anyway); start afresh."""
        if self.memory is not None:
            self.memory.clear()

    async def _unlocked(
        self, cluster_id: str, batch: Batch, prepared: TenantLimits
    ) -> Committed[CheckpointEffects] | None:
        """The batch's offsets, runs and reducers from the checkpointer's memory of its
        own writes (:class:`RunMemory`) where it holds them all, else read as committed
        without a lock and outside a transaction (:func:`locked.load_unlocked`: one
        round trip); fold; write in one statement that commits alone: one or two round
        trips where a transaction takes four (BEGIN, the first statement, the write,
        COMMIT). The statement checks that each partition's stored offset, each run
        written and (from memory) each workflow's reducers are what was read or
        remembered (``_WRITE``'s ``verdict``), or fails whole. In a transaction still
        (the write's locks held to its end) when the batch has dead letters,
        hand-offs, replies or LangGraph rows to store beside it. None: the locked path
        applies the batch (a partition with no stored offset yet, or a batch that
        writes no run)."""
        events = _events(batch)
        wants = _wants(events)
        partitions = [tp for tp, records in batch.items() if records]
        recalled = (
            self.memory.recall(partitions, wants.runs, wants.with_state, wants.workflows)
            if self.memory is not None
            else None
        )
        async with self.pool.acquire() as conn:
            if recalled is None:
                seen = await locked.load_unlocked(conn, self.group_id, cluster_id, batch, wants)
                stored, reads, configs = seen.stored, seen.reads, None
            else:
                stored, reads, configs = recalled.stored, _reads(recalled), recalled.config_versions
            if any(tp not in stored for tp in partitions):
                return None  # a partition's first batch: its offsets' row is made fenced
            fence = offsets.fenced(batch, stored)
            if not fence.fresh:
                return Committed(fence.progress)
            plan = await self._fold(conn, cluster_id, fence.fresh, prepared, reads)
            if not plan.writes_runs:
                return None
            checks = plan.checks(stored, configs)
            effects = self._effects(
                plan, written=True, read_again=False, unlocked=True, recalled=recalled is not None
            )
            if effects.dead_letters or effects.outbox or plan.sequencer.effects.graph:
                async with conn.transaction():
                    versions = await self._write(conn, plan, checks)
                    ids = await self.store_extras(conn, cluster_id, effects)
            else:
                versions = await self._write(conn, plan, checks)
                ids = []
        if self.memory is not None:
            plan.remember(self.memory, versions, recalled=recalled is not None)
        return Committed(fence.progress_after(), effects, ids)

    async def write(
        self,
        conn: asyncpg.Connection,
        cluster_id: str,
        fresh: Batch,
        prepared: TenantLimits,
        reads: locked.Reads | None,
    ) -> CheckpointEffects:
        """Under the runs' locks: load what the batch needs (unless :meth:`open` did),
        fold it in pure code (:class:`Sequencer`), write (advancing the offsets in the
        same statement); see the module docstring."""
        if reads is None:
            reads = await locked.lock_and_load(conn, _wants(_events(fresh)))
        plan = await self._fold(conn, cluster_id, fresh, prepared, reads)
        if not plan.writes_runs:
            await graphs.insert(conn, plan.sequencer.effects.graph)
            if plan.notify:
                await announce(conn, plan.touched)  # dead letters only: nothing written
            return self._effects(plan, written=False, read_again=reads.read_again)
        versions = await self._write(conn, plan, _NO_CHECKS)
        # the plan and the runs' new versions: memory's, once the transaction commits
        return self._effects(
            plan, written=True, read_again=reads.read_again, plan_kept=True, versions=versions
        )

    async def _fold(
        self,
        conn: asyncpg.Connection,
        cluster_id: str,
        fresh: Batch,
        prepared: TenantLimits,
        reads: locked.Reads,
    ) -> _Plan:
        """The batch's effects, in pure code (:class:`Sequencer`) but for the standing
        of tenants at their storage quota, read again before refusing a new run."""
        events = _events(fresh)
        full = prepared.full
        if full:
            starting = {
                e.tenant_id
                for e in events
                if e.tenant_id in full and (e.tenant_id, e.run_id) not in reads.runs
            }  # tenants of the batch's new runs: read again before refusing one
            full = await self._still_full(conn, starting) if starting else frozenset()
        existing = frozenset(reads.runs)
        heads_read = {key: (h.seq, h.state_hash) for key, h in reads.locked.heads.items()}
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
        heads: dict[HeadKey, CheckpointRow] = {}
        for row in sequencer.effects.checkpoints:
            heads[(row.tenant_id, row.run_id, branch_key(row.branch_id))] = row
        touched = [(e.tenant_id, e.run_id) for e in events] + [
            (d.tenant_id, d.run_id) for d in letters if d.tenant_id and d.run_id
        ]
        return _Plan(
            sequencer=sequencer,
            letters=letters,
            outbox=self._handoffs(sequencer, fresh) + answers,
            heads=heads,
            touched=touched,
            notify=tokens(touched) if self.config.notify_effects else [],
            advance=advance_args(self.group_id, cluster_id, ends(fresh)),
            created_at=datetime.now(UTC),
            existing=existing,
            heads_read=heads_read,
            reads=reads,
            wants=_wants(events),
        )

    @staticmethod
    def _effects(
        plan: _Plan,
        *,
        written: bool,
        read_again: bool,
        unlocked: bool = False,
        recalled: bool = False,
        plan_kept: bool = False,
        versions: dict[RunKey, str] | None = None,
    ) -> CheckpointEffects:
        effects = plan.sequencer.effects
        return CheckpointEffects(
            dead_letters=plan.letters,
            outbox=plan.outbox,
            cache_writes=_cache_entries(plan.heads.values(), plan.created_at),
            offsets_stored=written,
            checkpoints=effects.checkpoints,
            applied=[(e.event.type, e.effect, e.event.emitted_at) for e in effects.events],
            duplicates=effects.duplicates,
            created_at=plan.created_at,
            folded=effects.events,
            read_again=read_again,
            unlocked=unlocked,
            recalled=recalled,
            plan=plan if plan_kept else None,
            versions=versions or {},
        )

    async def _still_full(self, conn: asyncpg.Connection, tenants: set[str]) -> frozenset[str]:
        """Which of ``tenants`` (at their quota when last read) are at it now."""
        standings = await tenant_settings.storage(conn, self.config.storage_quota, tenants)
        return frozenset(s.tenant_id for s in standings if s.full)

    # -- writes ---------------------------------------------------------------

    async def _write(
        self, conn: asyncpg.Connection, plan: _Plan, checks: _Checks
    ) -> dict[RunKey, str]:
        """The batch's runs, checkpoints, heads and audit rows, the notifications and
        the offsets' advance (:func:`offsets.advance_args`) in one statement (one round
        trip, one execution per table rather than one per row), checked as ``checks``
        says, then its LangGraph rows. Returns each run's new row version."""
        seq = plan.sequencer
        runs = plan.runs_written
        events = seq.effects.events
        row = await conn.fetchrow(
            _WRITE,
            *rows_args(
                seq.effects.checkpoints,
                plan.created_at,
                [(*key, row.seq, row.state_hash) for key, row in plan.heads.items()],
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
            plan.notify,
            *plan.advance,
            *checks.args(),
        )
        await graphs.insert(conn, seq.effects.graph)
        assert row is not None
        return {(t, r): version for t, r, version in row["versions"]}

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
