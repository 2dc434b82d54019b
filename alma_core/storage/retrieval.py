"""Scoped retrieval: "what do we know about this task?" for a tenant, workflow,
run, node or agent, as a :class:`~alma_core.memory.MemorySlice`.

1. The scope becomes a filter (:mod:`alma_core.scopes`); a bad context is refused.
2. The task is embedded (the same model and cache as the learner).
3. The reads run as the ``alma_reader`` role with the tenant set for the
   transaction: PostgreSQL's row-level security admits only that tenant's rows,
   whatever the query says (docs/guarantees.md §6).
4. The plan follows the scope's size, as PostgreSQL's statistics estimate it (no row
   is read to choose): up to ``exact_max_rows`` rows, an exact distance scan over
   the B-tree-filtered rows (exact, ~1 ms for hundreds of rows); a tenant or agent
   scope, read from one covering index without the table, up to
   ``index_exact_max_rows``; above, the HNSW index with pgvector's iterative scan
   (:func:`nearest_query`).
5. Candidates are re-ranked by :mod:`alma_core.scoring`; ``top_k`` per kind.

Memories and workflow outcomes are searched at once, each in its own transaction on
its own connection (steps 3 to 5 for each): a retrieval costs the slower search. A
memory search made one scan per kind (tenant and agent scopes, and HNSW) of a scope of
``fanout_min_rows`` or more is split over ``fanout`` connections by kind
(:func:`kind_groups`), so that PostgreSQL scans a large tenant's kinds on more than one
core. No search holds a connection while it waits for another: a retrieval cannot
deadlock a small pool.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg

from alma_core import errors, scopes
from alma_core.memory import ArtifactLink, Memory, MemoryKind, MemorySlice, WorkflowOutcome
from alma_core.scoring import ScoringWeights, Signals, kind_signals, run_signals, score
from alma_core.settings import Settings
from alma_core.storage.embeddings import TextEmbedder, vector_literal
from alma_core.storage.observer import ReadMetrics, ReadObserver
from alma_core.storage.postgres import is_storage_failure, storage_error
from alma_core.types import RetrievalScope, WorkflowContext

READER_ROLE = "alma_reader"
SLICE_KINDS: dict[MemoryKind, str] = {
    MemoryKind.HEURISTIC: "heuristics",
    MemoryKind.ANTI_PATTERN: "anti_patterns",
    MemoryKind.DOMAIN_KNOWLEDGE: "domain_knowledge",
    MemoryKind.PREFERENCE: "preferences",
    MemoryKind.OUTCOME: "outcomes",
}
_MEMORY_COLUMNS = """id, tenant_id, kind, agent, workflow_id, run_id, node_id, content,
    condition, strategy, occurrences, successes, confidence, metadata, created_at, updated_at"""
_OUTCOME_COLUMNS = """id, tenant_id, workflow_id, workflow_version, run_id, success, duration_ms,
    node_count, nodes_succeeded, nodes_failed, error_message, failing_node, task, description,
    learnings_extracted, created_at"""

# The scope columns ``memories_vectors`` is keyed by (after the kind): scopes filtered on
# these alone are searched exactly without reading the table.
_COVERED = frozenset({"tenant_id", "agent"})

# How long a scope's size, as the planner estimates it (which the plan and the fan-out
# follow), is reused; and how many scopes' sizes are kept (the least recently used go
# first).
PLAN_TTL_S = 60.0
SIZES_KEPT = 4096
# The memory kinds, in the order a slice and its searches list them.
KINDS = tuple(k.value for k in MemoryKind)
# The smallest memory scope (the planner's estimate) whose search is split over more
# than one connection: below it, a scan costs what the extra round trips do
# (docs/benchmarks.md, "Learner and scoped retrieval").
FANOUT_MIN_ROWS = 10_000

T = TypeVar("T", Memory, WorkflowOutcome)
# (score, similarity, row): a candidate as ranked, before its item is built (for the
# candidates kept only: building one per candidate was half the ranking's time)
Ranked = tuple[float, float, asyncpg.Record]


class Retriever:
    def __init__(
        self,
        pool: asyncpg.Pool,
        embedder: TextEmbedder,
        *,
        weights: ScoringWeights | None = None,
        require_tenant: bool = True,
        exact_max_rows: int = 5000,
        index_exact_max_rows: int = 50000,
        ef_search: int = 100,
        fanout: int = 2,
        fanout_min_rows: int = FANOUT_MIN_ROWS,
        observer: ReadObserver | None = None,
        plan_ttl_s: float = PLAN_TTL_S,
    ) -> None:
        if fanout < 1:
            raise ValueError(f"fanout must be at least 1, not {fanout}")
        self.pool = pool
        self.embedder = embedder
        self.weights = weights or ScoringWeights()
        self.require_tenant = require_tenant
        self.exact_max_rows = exact_max_rows
        self.index_exact_max_rows = index_exact_max_rows
        self.ef_search = ef_search
        self.fanout = fanout
        self.fanout_min_rows = fanout_min_rows
        self.observer = observer or ReadMetrics.shared()
        self.plan_ttl_s = plan_ttl_s
        # (table, filter, its values) -> (estimated at, the scope's estimated rows)
        self._sizes: OrderedDict[tuple[str, ...], tuple[float, float]] = OrderedDict()

    @classmethod
    def configured(
        cls,
        pool: asyncpg.Pool,
        embedder: TextEmbedder,
        settings: Settings,
        observer: ReadObserver | None = None,
    ) -> Retriever:
        """A retriever with the weights, tenancy and plan limits the settings give."""
        return cls(
            pool,
            embedder,
            weights=settings.scoring_weights,
            require_tenant=settings.require_tenant,
            exact_max_rows=settings.retrieval_exact_max_rows,
            index_exact_max_rows=settings.retrieval_index_exact_max_rows,
            ef_search=settings.retrieval_ef_search,
            fanout=settings.retrieval_fanout,
            observer=observer,
        )

    async def retrieve(
        self,
        task: str,
        context: WorkflowContext,
        scope: RetrievalScope = RetrievalScope.WORKFLOW,
        *,
        agent: str | None = None,
        top_k: int = 5,
        include_workflow_outcomes: bool = True,
        plan: str | None = None,
    ) -> MemorySlice:
        """The ``top_k`` best memories of each kind in ``scope``, for ``task``.
        ``plan`` forces "exact" or "approximate" (benchmarks compare them)."""
        if top_k < 1:
            raise errors.ContextError("top_k must be at least 1")
        if plan not in (None, "exact", "approximate"):
            raise errors.ContextError(f"unknown plan {plan!r}: exact or approximate")
        started = time.perf_counter()
        mem_filter = scopes.memory_filter(
            context, scope, agent=agent, require_tenant=self.require_tenant
        )
        out_filter = scopes.outcome_filter(context, mem_filter)
        query = vector_literal((await self.embedder.embed([task]))[0])
        try:
            sizes = [self._size("memories", mem_filter)]
            if include_workflow_outcomes and plan is None:
                sizes.append(self._size("workflow_outcomes", out_filter))
            mem_rows, *out_rows = await asyncio.gather(*sizes)
            chosen = plan or self._choose("memories", mem_filter, mem_rows)
            fanout = self.fanout if mem_rows >= self.fanout_min_rows else 1
            # each search on its own connection, at once: the outcomes' and a large
            # scope's kinds run while PostgreSQL scans the rest
            memories_found = asyncio.gather(
                *(
                    self._search(
                        "memories",
                        mem_filter,
                        query,
                        top_k * 3,
                        chosen,
                        _memory,
                        _memory_signals,
                        lambda ranked: _best_per_kind(ranked, top_k),
                        kinds,
                    )
                    for kinds in kind_groups(chosen, mem_filter, fanout)
                )
            )
            outcomes_found = (
                self._search(
                    "workflow_outcomes",
                    out_filter,
                    query,
                    top_k * 3,
                    plan or self._choose("workflow_outcomes", out_filter, out_rows[0]),
                    _outcome,
                    _outcome_signals,
                    lambda ranked: _best(ranked, top_k),
                )
                if include_workflow_outcomes
                else _nothing()
            )
            groups, outcomes = await asyncio.gather(memories_found, outcomes_found)
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, "retrieving memories") from exc
            raise
        memories = [m for group in groups for m in group]
        result = MemorySlice(query=task, agent=agent, scope=scope, plan=chosen)
        for kind, attr in SLICE_KINDS.items():
            setattr(result, attr, [m for m in memories if m.kind is kind])
        result.workflow_outcomes = outcomes
        elapsed = time.perf_counter() - started
        result.retrieval_time_ms = elapsed * 1000
        self.observer.retrieval(scope.value, chosen, elapsed)
        return result

    async def _search(
        self,
        table: str,
        f: scopes.ScopeFilter,
        query: str,
        candidates: int,
        plan: str,
        build: Callable[[asyncpg.Record, float, float, tuple[ArtifactLink, ...]], T],
        signals: Callable[[asyncpg.Record, datetime], Signals],
        keep: Callable[[list[Ranked]], list[Ranked]],
        kinds: Sequence[str] | None = None,
    ) -> list[T]:
        """The items ``keep`` chose of the ``candidates`` nearest in ``table`` (of
        ``kinds`` only, where given), with their scores and artifacts: one read-only
        transaction on one connection."""
        async with self.pool.acquire() as conn, conn.transaction(readonly=True):
            await _as_reader(conn, f)
            if plan != "exact":
                await _approximate(conn, self.ef_search)
            sql, args = nearest_query(table, plan, query, f, candidates, kinds)
            rows = await conn.fetch(sql, *args)
        return [
            build(row, value, similarity, _links(row["artifacts"]))
            for value, similarity, row in keep(self._rank(rows, signals))
        ]

    def _choose(self, table: str, f: scopes.ScopeFilter, rows: float) -> str:
        """Exact up to the scope's limit, HNSW above. An estimate can be off until the
        next ANALYZE (autovacuum runs one after 10 % of a table changed): a scope that
        grew past its limit is searched exactly a while longer (right, slower), one
        that shrank below it approximately (fast, recall as HNSW gives it)."""
        limit = self.index_exact_max_rows if covered(table, f) else self.exact_max_rows
        return "exact" if rows <= limit else "approximate"

    async def _size(self, table: str, f: scopes.ScopeFilter) -> float:
        """The scope's rows as the planner estimates them, from the statistics ANALYZE
        keeps (with 0010's on tenant and workflow, tenant and agent): no row is read.
        Counting the scope instead (up to the limit) cost as much as a tenant's search
        itself (a 20,000-row tenant: ~4 ms warm, more when its pages were not cached).
        Run as the connection's own role, before row-level security applies: the
        policy's condition would count in the estimate, not the scope's.

        A scope's estimate is reused for ``plan_ttl_s`` (60 s): it moves only with
        ANALYZE, and the probe is a round trip on the search's path (~0.5 ms). The probe
        takes a pooled connection of its own and gives it back before any search
        starts."""
        where, args = f.sql(1)
        key = (table, where, *args)
        now = time.monotonic()
        kept = self._sizes.get(key)
        if kept is not None and now - kept[0] < self.plan_ttl_s:
            self._sizes.move_to_end(key)
            return kept[1]
        explained = await self.pool.fetchval(
            f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {table} WHERE {where}", *args
        )
        if isinstance(explained, str):  # a pool without this project's json codec
            explained = json.loads(explained)
        rows = float(explained[0]["Plan"]["Plan Rows"])
        self._sizes[key] = (now, rows)
        self._sizes.move_to_end(key)
        while len(self._sizes) > SIZES_KEPT:
            self._sizes.popitem(last=False)
        return rows

    def _rank(
        self, rows: list[asyncpg.Record], signals: Callable[[asyncpg.Record, datetime], Signals]
    ) -> list[Ranked]:
        """Each row with its score and similarity."""
        now = datetime.now(UTC)
        out = []
        for r in rows:
            sig = signals(r, now)
            out.append((score(sig, self.weights), sig.similarity, r))
        return out


async def _nothing() -> list[WorkflowOutcome]:
    return []


def _best(ranked: Iterable[Ranked], top_k: int) -> list[Ranked]:
    """The ``top_k`` highest scores, in score order (ties keep the rows' order)."""
    return sorted(ranked, key=lambda x: -x[0])[:top_k]


def _best_per_kind(ranked: list[Ranked], top_k: int) -> list[Ranked]:
    """The ``top_k`` highest scores of each kind."""
    return [x for k in KINDS for x in _best((m for m in ranked if m[2]["kind"] == k), top_k)]


def _memory_signals(r: asyncpg.Record, now: datetime) -> Signals:
    return kind_signals(
        r["kind"],
        r["occurrences"],
        r["successes"],
        float(r["confidence"]),
        r["updated_at"] or r["created_at"],
        r["distance"],
        now,
    )


def _outcome_signals(r: asyncpg.Record, now: datetime) -> Signals:
    return run_signals(r["success"], r["created_at"], r["distance"], now)


async def learned_from_run(
    pool: asyncpg.Pool, tenant_id: str, run_id: str
) -> tuple[asyncpg.Record | None, list[asyncpg.Record]]:
    """What the learner made of a finished run: its outcome, and the memories it fed (its
    node outcomes; the heuristic of its strategy and the anti-pattern of its failure,
    which other runs feed too). Read as retrieval reads, under row-level security."""
    async with pool.acquire() as conn, conn.transaction(readonly=True):
        await _as_reader(conn, scopes.ScopeFilter((("tenant_id", tenant_id),), False, tenant_id))
        outcome = await conn.fetchrow(
            """SELECT success, duration_ms, node_count, nodes_succeeded, nodes_failed,
                      error_message, failing_node, task, description, strategy,
                      error_signature, learnings_extracted, created_at, workflow_id
               FROM workflow_outcomes WHERE tenant_id = $1 AND run_id = $2""",
            tenant_id,
            run_id,
        )
        fed = await conn.fetch(
            """SELECT kind, content, condition, occurrences, successes, confidence, node_id,
                      updated_at
               FROM memories m
               WHERE m.tenant_id = $1 AND (
                 m.run_id = $2
                 OR (m.kind = 'heuristic' AND m.dedupe_key = $3 || chr(31) || $4)
                 OR (m.kind = 'anti_pattern' AND m.dedupe_key = $3 || chr(31) || $5))
               ORDER BY m.kind, m.content""",
            tenant_id,
            run_id,
            outcome["workflow_id"] if outcome else "",
            (outcome["strategy"] if outcome else None) or "",
            (outcome["error_signature"] if outcome else None) or "",
        )
    return outcome, list(fed)


async def _as_reader(conn: asyncpg.Connection, f: scopes.ScopeFilter) -> None:
    """Row-level security from here to the end of the transaction (``role`` set as
    ``SET LOCAL ROLE`` sets it, in the same round trip as the tenant). Plans made for
    each query's values: the best plan depends on the scope's size, which a generic
    plan of a prepared statement (PostgreSQL's choice after five runs) cannot know
    (docs/learner.md)."""
    await conn.execute(
        "SELECT set_config('role', $1, true), set_config('alma.tenant_id', $2, true), "
        "set_config('alma.all_tenants', $3, true), "
        "set_config('plan_cache_mode', 'force_custom_plan', true)",
        READER_ROLE,
        f.tenant_id or "",
        "on" if f.all_tenants else "off",
    )


async def _approximate(conn: asyncpg.Connection, ef_search: int) -> None:
    # hnsw.* settings exist once the library is loaded; a vector expression loads it
    # (LOAD itself needs a superuser).
    await conn.fetchval("SELECT '[1]'::vector IS NOT NULL")
    await conn.execute("SET LOCAL hnsw.iterative_scan = relaxed_order")
    await conn.execute(f"SET LOCAL hnsw.ef_search = {int(ef_search)}")


def _links(rows: str | list[list[Any]] | None) -> tuple[ArtifactLink, ...]:
    """An item's artifact links as its row carried them (see :func:`with_artifacts`)."""
    links: list[list[Any]] = (
        json.loads(rows) if isinstance(rows, str) else rows or []  # str: no json codec
    )
    return tuple(
        ArtifactLink(artifact_id, kind, path, content_hash, size, metadata or {})
        for artifact_id, kind, path, content_hash, size, metadata in links
    )


def _memory(
    r: asyncpg.Record, score: float, similarity: float, artifacts: tuple[ArtifactLink, ...]
) -> Memory:
    return Memory(
        id=str(r["id"]),
        tenant_id=r["tenant_id"],
        kind=MemoryKind(r["kind"]),
        content=r["content"],
        agent=r["agent"],
        workflow_id=r["workflow_id"],
        run_id=r["run_id"],
        node_id=r["node_id"],
        condition=r["condition"],
        strategy=r["strategy"],
        occurrences=r["occurrences"],
        successes=r["successes"],
        confidence=float(r["confidence"]),
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        metadata=r["metadata"] or {},
        artifacts=artifacts,
        similarity=similarity,
        score=score,
    )


def _outcome(
    r: asyncpg.Record, score: float, similarity: float, artifacts: tuple[ArtifactLink, ...]
) -> WorkflowOutcome:
    return WorkflowOutcome(
        id=str(r["id"]),
        tenant_id=r["tenant_id"],
        workflow_id=r["workflow_id"],
        workflow_version=r["workflow_version"],
        run_id=r["run_id"],
        success=r["success"],
        duration_ms=r["duration_ms"],
        node_count=r["node_count"],
        nodes_succeeded=r["nodes_succeeded"],
        nodes_failed=r["nodes_failed"],
        error_message=r["error_message"],
        failing_node=r["failing_node"],
        task=r["task"],
        description=r["description"],
        learnings_extracted=r["learnings_extracted"],
        created_at=r["created_at"],
        artifacts=artifacts,
        similarity=similarity,
        score=score,
    )


def kind_groups(plan: str, f: scopes.ScopeFilter, fanout: int) -> list[tuple[str, ...] | None]:
    """The memory kinds each of a memory search's connections scans: ``fanout`` groups
    of neighbouring kinds (as even as five kinds allow) where the plan scans each kind
    apart (HNSW, or exact from the covering index), else one search of every kind
    (``None``: the exact scan of a small scope reads its rows once for all kinds)."""
    if not scans_each_kind(plan, f):
        return [None]
    n = max(1, min(fanout, len(KINDS)))
    size, extra = divmod(len(KINDS), n)
    groups: list[tuple[str, ...] | None] = []
    start = 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        groups.append(KINDS[start:end])
        start = end
    return groups


def scans_each_kind(plan: str, f: scopes.ScopeFilter) -> bool:
    """Whether a memory search on ``plan`` scans each kind apart (HNSW, or exact from
    the covering index), so that it can be split by kind."""
    return plan != "exact" or covered("memories", f)


def covered(table: str, f: scopes.ScopeFilter) -> bool:
    """Whether ``memories_vectors`` alone answers the scope's exact search."""
    return table == "memories" and f.columns() <= _COVERED


def nearest_query(
    table: str,
    plan: str,
    query: str,
    f: scopes.ScopeFilter,
    limit: int,
    kinds: Sequence[str] | None = None,
) -> tuple[str, list[object]]:
    """The statement (and its arguments) for the ``limit`` rows of ``table`` nearest to
    ``query`` in the scope, per kind for memories (of ``kinds`` only, where given: the
    plans that scan each kind apart).

    exact, a tenant or agent scope of memories: ranked from ``memories_vectors``
    alone (0009), one bounded scan per kind; its half-precision copies of the
    embeddings order the candidates and each candidate's distance is computed again
    from the full vector (what the score uses). Orderings by the half copy cannot use
    the HNSW index, which is built on the full one.
    exact, any other scope: distances over the B-tree-filtered rows, in a
    materialised CTE that keeps the HNSW index out (an ``ORDER BY`` on the distance,
    even by alias, lets the planner pick HNSW, which loses recall under a filter).
    Only ids, kinds and distances are carried through the ranking; the nearest rows'
    columns are read after.
    approximate: the HNSW index with iterative scan; for memories one scan per kind,
    so no kind crowds the others out."""
    sql, args = _nearest_rows(table, plan, query, f, limit, kinds)
    return with_artifacts(sql, "memory" if table == "memories" else "outcome"), args


def with_artifacts(sql: str, owner_type: str) -> str:
    """``sql``'s rows, each with its artifact links (``artifacts``: a JSON array of
    [id, type, path, hash, size, metadata], or null) read in the same statement, from
    the links' unique index (owner type, owner id). A search returns a few dozen
    candidates per kind; reading their links here costs less than a round trip after."""
    if owner_type not in ("memory", "outcome"):
        raise ValueError(f"unknown owner type {owner_type!r}")
    return f"""SELECT n.*, (
                   SELECT json_agg(json_build_array(a.artifact_id, a.artifact_type,
                                   a.storage_path, a.content_hash, a.size_bytes, a.metadata)
                                   ORDER BY a.id)
                   FROM artifact_links a
                   WHERE a.owner_type = '{owner_type}' AND a.owner_id = n.id) AS artifacts
               FROM ({sql}) n"""


def _nearest_rows(
    table: str,
    plan: str,
    query: str,
    f: scopes.ScopeFilter,
    limit: int,
    only: Sequence[str] | None,
) -> tuple[str, list[object]]:
    columns = _MEMORY_COLUMNS if table == "memories" else _OUTCOME_COLUMNS
    kinds = list(KINDS if only is None else only)
    if only is not None and (table != "memories" or not scans_each_kind(plan, f)):
        raise ValueError(f"a {plan} search of {table} in this scope reads every kind at once")
    if plan == "exact" and covered(table, f):
        where, args = f.sql(5)
        sql = f"""SELECT {columns}, m.embedding <=> $1::vector AS distance
                  FROM unnest($3::text[]) AS k(wanted) CROSS JOIN LATERAL (
                      SELECT id FROM memories
                      WHERE kind = k.wanted AND {where} AND embedding_half IS NOT NULL
                      ORDER BY embedding_half <=> $4::halfvec LIMIT $2) nearest
                  JOIN memories m USING (id)"""
        # the query once more, typed halfvec: converted once at bind, not once a row
        return sql, [query, limit, kinds, query, *args]
    if plan == "exact":
        where, args = f.sql(3)
        per_kind = table == "memories"
        nearest = (
            "SELECT id, distance FROM (SELECT id, distance, row_number() OVER "
            "(PARTITION BY kind ORDER BY distance) AS rank FROM scoped) r WHERE rank <= $2"
            if per_kind
            else "SELECT id, distance FROM scoped ORDER BY distance LIMIT $2"
        )
        kind = ", kind" if per_kind else ""
        sql = f"""WITH scoped AS MATERIALIZED (
                      SELECT id{kind}, embedding <=> $1::vector AS distance
                      FROM {table} WHERE {where} AND embedding IS NOT NULL),
                  nearest AS ({nearest})
                  SELECT {columns}, distance FROM nearest JOIN {table} USING (id)"""
        return sql, [query, limit, *args]
    if table != "memories":
        where, args = f.sql(3)
        sql = f"""SELECT {columns}, embedding <=> $1::vector AS distance FROM {table}
                  WHERE {where} AND embedding IS NOT NULL
                  ORDER BY embedding <=> $1::vector LIMIT $2"""
        return sql, [query, limit, *args]
    where, args = f.sql(4)
    sql = f"""SELECT m.* FROM unnest($3::text[]) AS k(kind) CROSS JOIN LATERAL (
                  SELECT {columns}, embedding <=> $1::vector AS distance
                  FROM {table}
                  WHERE kind = k.kind AND {where} AND embedding IS NOT NULL
                  ORDER BY embedding <=> $1::vector LIMIT $2) m"""
    return sql, [query, limit, kinds, *args]
