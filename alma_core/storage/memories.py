"""PostgresLearnStore: finished runs become outcomes and memories, exactly once.

The learner reads what it needs first (the runs' event history, which outcomes
exist already), drafts and embeds outside any transaction (embedding is slow),
then applies one transaction per polled batch:

* offsets fenced as for the checkpointer (:mod:`alma_core.storage.offsets`);
* one outcome per run: ``workflow_outcomes`` is unique by ``event_id`` and by
  (tenant, run), so a re-delivered or re-published completion writes nothing;
* memories are upserted by (tenant, kind, dedupe key) with counts recomputed
  from the stored outcomes, so nothing is counted twice;
* artifacts linked to the outcome and to the memories learned from the run;
* ``cleanup_checkpoints``: the run's checkpoints are deleted in the same
  transaction, after everything was learned from them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg

from alma_core import errors, learning
from alma_core.learning import LearningPolicy, OutcomeDraft
from alma_core.schemas.decoder import Rejection
from alma_core.schemas.events import ArtifactRef, WorkflowCompleted
from alma_core.sequencing import Coordinates
from alma_core.storage import retention
from alma_core.storage.batches import Batch, BatchStore, Effects, guarded
from alma_core.storage.dead_letters import dead_letter_for
from alma_core.storage.embeddings import Vector, vector_literal
from alma_core.storage.postgres import columns


@dataclass(frozen=True)
class LearnConfig:
    group_id: str
    consumer: str
    dlq_topic: str
    policy: LearningPolicy = field(default_factory=LearningPolicy)
    cleanup_checkpoints: bool = False


@dataclass(frozen=True)
class Prepared:
    """A completion drafted and embedded, ready for the transaction."""

    draft: OutcomeDraft
    vectors: dict[str, Vector]
    artifacts: list[ArtifactRef]
    cleanup: bool
    learn: bool = True  # False: its tenant's learner is off (no outcome, no memory)


@dataclass
class LearnEffects(Effects):
    """A learner batch: outcomes stored and skipped, memories written by kind, and the
    checkpoints removed by cleanup (their runs are in ``cache_forgets``)."""

    outcomes: int = 0
    duplicates: int = 0
    memories: Counter[str] = field(default_factory=Counter)
    checkpoints_removed: int = 0
    not_learned: int = 0  # completions of tenants whose learner is off
    # outcome event id: learned, duplicate, not_learned
    by_event: dict[str, str] = field(default_factory=dict)

    def span_attributes(self) -> dict[str, dict[str, Any]]:
        out = {eid: {"alma.outcome": what} for eid, what in self.by_event.items()}
        return out | super().span_attributes()


async def check_dimension(pool: asyncpg.Pool, dimension: int, model: str) -> None:
    """The embedding columns must have the model's dimension: vectors of another model
    would be compared with the stored ones and make retrieval silently wrong."""
    rows = await pool.fetch(
        """SELECT attrelid::regclass::text AS tbl, atttypmod AS dims FROM pg_attribute
           WHERE attname = 'embedding' AND attnum > 0
             AND attrelid IN ('memories'::regclass, 'workflow_outcomes'::regclass)"""
    )
    wrong = [f"{r['tbl']}.embedding is vector({r['dims']})" for r in rows if r["dims"] != dimension]
    if wrong:
        raise errors.ConfigError(
            f"the embedding model {model} makes {dimension}-dimensional vectors but "
            f"{'; '.join(wrong)}: use a {rows[0]['dims']}-dimensional model "
            "(ALMA_EMBEDDING_MODEL_PATH), or migrate the columns to the model's dimension "
            "and re-embed"
        )


class PostgresLearnStore(BatchStore[dict[Coordinates, Prepared], LearnEffects, None]):
    doing = "storing outcomes"

    def __init__(self, pool: asyncpg.Pool, config: LearnConfig) -> None:
        super().__init__(
            pool, config.group_id, consumer=config.consumer, dlq_topic=config.dlq_topic
        )
        self.config = config

    # -- reads before the transaction -------------------------------------------

    async def histories(
        self, runs: list[tuple[str, str]]
    ) -> dict[tuple[str, str], list[learning.HistoryEvent]]:
        """Each run's audit log, in order, by (tenant, run id)."""
        if not runs:
            return {}

        async def read() -> list[asyncpg.Record]:
            rows: list[asyncpg.Record] = await self.pool.fetch(
                # A LangGraph task's writes (graph.writes with a node) are its node's
                # completion, or its failure when they hold an error.
                """SELECT e.tenant_id, e.run_id, e.node_id, e.branch_id,
                          CASE WHEN e.type <> 'graph.writes' THEN e.type
                               WHEN e.payload->'error' IS NOT NULL THEN 'node.failed'
                               ELSE 'node.completed' END AS type,
                          e.payload->'error'->>'type' AS error_type,
                          e.payload->'error'->>'message' AS error_message
                   FROM run_events e
                   JOIN unnest($1::text[], $2::text[]) AS u(t, r)
                     ON e.tenant_id = u.t AND e.run_id = u.r
                   WHERE e.type IN ('node.completed', 'node.failed')
                      OR (e.type = 'graph.writes' AND e.node_id IS NOT NULL)
                   ORDER BY e.tenant_id, e.run_id, e.ordinal""",
                *columns(runs, 2),
            )
            return rows

        out: dict[tuple[str, str], list[learning.HistoryEvent]] = {run: [] for run in runs}
        for row in await guarded("reading run histories", read()):
            out[(row["tenant_id"], row["run_id"])].append(
                learning.HistoryEvent(
                    row["type"],
                    row["node_id"],
                    row["branch_id"],
                    row["error_type"],
                    row["error_message"],
                )
            )
        return out

    async def learned(self, events: list[WorkflowCompleted]) -> set[tuple[str, str]]:
        """(tenant, event id) of the completions whose run already has an outcome
        (nothing to embed for them)."""
        if not events:
            return set()

        async def read() -> list[asyncpg.Record]:
            rows: list[asyncpg.Record] = await self.pool.fetch(
                """SELECT u.t, u.e FROM unnest($1::text[], $2::text[], $3::text[]) AS u(e, t, r)
                   WHERE EXISTS (
                       SELECT 1 FROM workflow_outcomes o
                       WHERE o.tenant_id = u.t AND (o.event_id = u.e OR o.run_id = u.r))""",
                [e.event_id for e in events],
                [e.tenant_id for e in events],
                [e.run_id for e in events],
            )
            return rows

        return {(r["t"], r["e"]) for r in await guarded("reading known outcomes", read())}

    # -- the transaction ----------------------------------------------------------

    async def write(
        self,
        conn: asyncpg.Connection,
        cluster_id: str,
        fresh: Batch,
        prepared: dict[Coordinates, Prepared],
        reads: None,
    ) -> LearnEffects:
        """Store the outcomes (one per run), then load the counts they change, decide
        what they teach (:func:`alma_core.learning.plan_memories`) and write it."""
        effects = LearnEffects()
        now = datetime.now(UTC)
        offered: list[Prepared] = []
        passed_by: list[Prepared] = []
        for records in fresh.values():
            for record in records:
                decoded = record.decoded
                if isinstance(decoded, Rejection):
                    effects.dead_letters.append(dead_letter_for(record, decoded))
                    continue
                if not isinstance(decoded, WorkflowCompleted):
                    continue  # joins are the joiner's
                item = prepared.get(record.coords)
                effects.by_event[decoded.event_id] = "duplicate"
                if item is None:
                    effects.duplicates += 1
                elif not item.learn:
                    effects.by_event[decoded.event_id] = "not_learned"
                    effects.not_learned += 1
                    passed_by.append(item)
                else:
                    offered.append(item)
        # a tenant's learner off: nothing of the run stored, but the cleanup it asked for
        await self._cleanup(conn, [i for i in passed_by if i.cleanup], effects)
        stored = await self._insert_outcomes(conn, offered, now)
        effects.duplicates += len(offered) - len(stored)
        for item in stored:
            effects.by_event[item.draft.run.event_id] = "learned"
        if not stored:
            return effects
        effects.outcomes = len(stored)
        drafts = [item.draft for item in stored]
        plan = learning.plan_memories(
            drafts,
            strategies=await self._counts(conn, drafts, "strategy"),
            failures=await self._counts(
                conn, [d for d in drafts if d.error_signature], "error_signature"
            ),
            policy=self.config.policy,
        )
        await self._write_memories(conn, stored, plan, now, effects)
        await conn.executemany(
            "UPDATE workflow_outcomes SET learnings_extracted = $2 WHERE id = $1",
            list(plan.learned.items()),
        )
        await self._cleanup(conn, [i for i in stored if i.cleanup], effects)
        return effects

    async def _insert_outcomes(
        self, conn: asyncpg.Connection, items: list[Prepared], now: datetime
    ) -> list[Prepared]:
        """Insert the outcomes in one statement (one round trip, not one per run); what
        it returns is those inserted, in order: a run or event stored before, or twice
        in the batch, is inserted once."""
        if not items:
            return []
        rows = [
            (
                d.id,
                d.run.tenant_id,
                d.run.workflow_id,
                d.run.workflow_version,
                d.run.run_id,
                d.run.event_id,
                d.run.success,
                d.run.duration_ms,
                d.run.node_count,
                d.run.nodes_succeeded,
                d.run.nodes_failed,
                d.run.error_message,
                d.failing_node,
                d.run.task,
                d.description,
                vector_literal(item.vectors[d.description]),
                d.strategy,
                d.error_signature,
            )
            for item in items
            for d in [item.draft]
        ]
        inserted = await conn.fetch(
            """INSERT INTO workflow_outcomes (id, tenant_id, workflow_id, workflow_version, run_id,
                   event_id, success, duration_ms, node_count, nodes_succeeded, nodes_failed,
                   error_message, failing_node, task, description, embedding, strategy,
                   error_signature, created_at)
               SELECT u.id, u.t, u.w, u.v, u.r, u.e, u.ok, u.ms, u.n, u.s, u.f, u.err, u.fn,
                      u.task, u.d, u.emb::vector, u.st, u.sig, $19
               FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                           $6::text[], $7::boolean[], $8::bigint[], $9::integer[],
                           $10::integer[], $11::integer[], $12::text[], $13::text[],
                           $14::text[], $15::text[], $16::text[], $17::text[], $18::text[])
                    WITH ORDINALITY
                    AS u(id, t, w, v, r, e, ok, ms, n, s, f, err, fn, task, d, emb, st, sig, i)
               ORDER BY u.i
               ON CONFLICT DO NOTHING RETURNING id""",
            *(list(column) for column in zip(*rows, strict=True)),
            now,
        )
        ids = {str(r["id"]) for r in inserted}
        stored: list[Prepared] = []
        for item in items:
            if item.draft.id in ids:
                ids.remove(item.draft.id)  # a run twice in the batch: its first is inserted
                stored.append(item)
                run = item.draft.run
                await self._link(conn, run.tenant_id, "outcome", item.draft.id, item.artifacts)
        return stored

    async def _write_memories(
        self,
        conn: asyncpg.Connection,
        stored: list[Prepared],
        plan: learning.MemoryPlan,
        now: datetime,
        effects: LearnEffects,
    ) -> None:
        vectors = {text: v for item in stored for text, v in item.vectors.items()}
        await conn.executemany(
            """UPDATE memories SET occurrences = $3, successes = $4, confidence = $5,
                      updated_at = $6
               WHERE tenant_id = $1 AND kind = 'heuristic' AND dedupe_key = $2""",
            [
                (
                    r.draft.tenant_id,
                    r.draft.dedupe_key,
                    r.occurrences,
                    r.successes,
                    r.confidence,
                    now,
                )
                for r in plan.fading
            ],
        )
        await conn.executemany(
            """INSERT INTO memories (id, tenant_id, kind, workflow_id, run_id, node_id, content,
                   condition, strategy, occurrences, successes, confidence, dedupe_key,
                   embedding, metadata, created_at, updated_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14::vector,
                       $15::jsonb, $16, $16)
               ON CONFLICT (tenant_id, kind, dedupe_key) DO UPDATE SET
                   content = EXCLUDED.content, embedding = EXCLUDED.embedding,
                   occurrences = EXCLUDED.occurrences, successes = EXCLUDED.successes,
                   confidence = EXCLUDED.confidence,
                   metadata = memories.metadata || EXCLUDED.metadata,
                   updated_at = EXCLUDED.updated_at""",
            [
                (
                    m.id,
                    m.tenant_id,
                    m.kind.value,
                    m.workflow_id,
                    m.run_id,
                    m.node_id,
                    m.content,
                    m.condition,
                    m.strategy,
                    r.occurrences,
                    r.successes,
                    r.confidence,
                    m.dedupe_key,
                    vector_literal(vectors[m.content]),
                    json.dumps(m.metadata),
                    now,
                )
                for r in plan.upserts.values()
                for m in [r.draft]
            ],
        )
        for row in plan.upserts.values():
            effects.memories[row.draft.kind.value] += 1
        for item in stored:  # the run's artifacts belong to what was learned from it
            owned = list(item.draft.node_outcomes)
            if item.draft.anti_pattern is not None and item.draft.anti_pattern.id in plan.upserts:
                owned.append(item.draft.anti_pattern)
            for m in owned:
                await self._link(conn, m.tenant_id, "memory", m.id, item.artifacts)

    async def _counts(
        self, conn: asyncpg.Connection, drafts: list[OutcomeDraft], column: str
    ) -> learning.Counts:
        """(outcomes, successes or failures) of each group of stored outcomes the drafts
        belong to, by strategy or by error signature."""
        keys = sorted({(d.run.tenant_id, d.run.workflow_id, getattr(d, column)) for d in drafts})
        if not keys:
            return {}
        counted = "o.success" if column == "strategy" else "NOT o.success"
        rows = await conn.fetch(
            f"""SELECT u.t, u.w, u.k, count(o.id) AS n, count(o.id) FILTER (WHERE {counted}) AS c
                FROM unnest($1::text[], $2::text[], $3::text[]) AS u(t, w, k)
                LEFT JOIN workflow_outcomes o
                  ON o.tenant_id = u.t AND o.workflow_id = u.w AND o.{column} = u.k
                GROUP BY u.t, u.w, u.k""",
            *columns(keys, 3),
        )
        return {(r["t"], r["w"], r["k"]): (r["n"], r["c"]) for r in rows}

    async def _link(
        self,
        conn: asyncpg.Connection,
        tenant_id: str,
        owner_type: str,
        owner_id: str,
        artifacts: list[ArtifactRef],
    ) -> None:
        if not artifacts:
            return
        await conn.executemany(
            """INSERT INTO artifact_links (tenant_id, owner_type, owner_id, artifact_id,
                   artifact_type, storage_path, content_hash, size_bytes, metadata)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb)
               ON CONFLICT (owner_type, owner_id, artifact_id) DO NOTHING""",
            [
                (
                    tenant_id,
                    owner_type,
                    owner_id,
                    a.id,
                    a.artifact_type,
                    a.storage_path,
                    a.content_hash,
                    a.size_bytes,
                    json.dumps(a.metadata),
                )
                for a in artifacts
            ],
        )

    async def _cleanup(
        self, conn: asyncpg.Connection, items: list[Prepared], effects: LearnEffects
    ) -> None:
        if not items:
            return
        runs = [(i.draft.run.tenant_id, i.draft.run.run_id) for i in items]
        effects.checkpoints_removed += await retention.delete_checkpoints(conn, runs)
        effects.cache_forgets = [*effects.cache_forgets, *runs]
