"""Scoped retrieval on the real PostgreSQL: random tenants, workflows, runs and
memories, random contexts and scopes; each scope returns exactly what its filter
admits (a brute-force reference), nothing from another tenant ever comes back,
and row-level security holds even for a query without a tenant filter."""

from __future__ import annotations

import asyncio
import json
import math
import random
import uuid
from typing import Any

import asyncpg
import pytest

from alma_core import errors, scopes
from alma_core.memory import Memory, estimate_tokens
from alma_core.storage import retrieval
from alma_core.storage.embeddings import AsyncEmbedder, vector_literal
from alma_core.storage.postgres import connect
from alma_core.storage.retrieval import Retriever
from alma_core.types import RetrievalScope, WorkflowContext
from tests.integration.harness import plan_nodes

TENANTS = ["t0", "t1", "t2"]
WORKFLOWS = ["w0", "w1", "w2"]
RUNS = [f"r{i}" for i in range(6)]
NODES = ["n0", "n1", "n2"]
AGENTS = ["a0", "a1"]
KINDS = ["heuristic", "anti_pattern", "domain_knowledge", "preference", "outcome"]


def unit_vector(rng: random.Random) -> list[float]:
    v = [rng.gauss(0, 1) for _ in range(384)]
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


async def seed(dsn: str, rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    memories: list[dict[str, Any]] = []
    for _ in range(400):
        run = rng.choice([*RUNS, None])
        memories.append(
            {
                "id": str(uuid.UUID(int=rng.getrandbits(128))),
                "tenant_id": rng.choice(TENANTS),
                "kind": rng.choice(KINDS),
                "agent": rng.choice([*AGENTS, None]),
                "workflow_id": rng.choice([*WORKFLOWS, None]),
                "run_id": run,
                "node_id": rng.choice(NODES) if run else None,
            }
        )
    outcomes: list[dict[str, Any]] = []
    for i in range(60):
        outcomes.append(
            {
                "id": str(uuid.UUID(int=rng.getrandbits(128))),
                "tenant_id": rng.choice(TENANTS),
                "workflow_id": rng.choice(WORKFLOWS),
                "run_id": f"run-{i}",
            }
        )
    conn = await asyncpg.connect(dsn)
    try:
        await conn.executemany(
            """INSERT INTO memories (id, tenant_id, kind, agent, workflow_id, run_id, node_id,
                   content, dedupe_key, confidence, embedding)
               VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $1::text, 0.5, $9::vector)""",
            [
                (
                    m["id"],
                    m["tenant_id"],
                    m["kind"],
                    m["agent"],
                    m["workflow_id"],
                    m["run_id"],
                    m["node_id"],
                    f"memory {m['id']}",
                    vector_literal(unit_vector(rng)),
                )
                for m in memories
            ],
        )
        await conn.executemany(
            """INSERT INTO workflow_outcomes (id, tenant_id, workflow_id, run_id, event_id,
                   success, duration_ms, node_count, nodes_succeeded, nodes_failed,
                   description, embedding)
               VALUES ($1::uuid, $2, $3, $4, $1::text, true, 10, 1, 1, 0, 'a run', $5::vector)""",
            [
                (
                    o["id"],
                    o["tenant_id"],
                    o["workflow_id"],
                    o["run_id"],
                    vector_literal(unit_vector(rng)),
                )
                for o in outcomes
            ],
        )
    finally:
        await conn.close()
    return memories, outcomes


def random_context(rng: random.Random) -> tuple[WorkflowContext, str | None]:
    tenant = rng.choice([*TENANTS, None])
    workflow = rng.choice([*WORKFLOWS, None])
    run = rng.choice([*RUNS, None]) if workflow else None
    node = rng.choice([*NODES, None]) if run else None
    return WorkflowContext(tenant, workflow, None, run, node), rng.choice([*AGENTS, None])


async def test_each_scope_returns_exactly_what_its_filter_admits(
    database: str, embedder: AsyncEmbedder
) -> None:
    rng = random.Random(20261122)
    memories, outcomes = await seed(database, rng)
    checked = refused = 0
    async with connect(database) as pool:
        retriever = Retriever(pool, embedder, require_tenant=True)
        for _ in range(60):
            ctx, agent = random_context(rng)
            scope = rng.choice(list(RetrievalScope))
            plan = rng.choice(["exact", "approximate"])
            try:
                mf = scopes.memory_filter(ctx, scope, agent=agent, require_tenant=True)
            except errors.ContextError:
                with pytest.raises(errors.ContextError):
                    await retriever.retrieve("anything", ctx, scope, agent=agent)
                refused += 1
                continue
            found = await retriever.retrieve(
                "anything", ctx, scope, agent=agent, top_k=1000, plan=plan
            )
            got = {m.id for m in found.items() if isinstance(m, Memory)}
            admitted = {m["id"] for m in memories if mf.admits(m)}
            assert {m.tenant_id for m in found.items()} <= {ctx.tenant_id}, "another tenant"
            if plan == "exact":
                assert got == admitted, (ctx, scope, agent)
            else:
                assert got <= admitted, (ctx, scope, agent)
            of = scopes.outcome_filter(ctx, mf)
            got_outcomes = {o.id for o in found.workflow_outcomes}
            admitted_outcomes = {o["id"] for o in outcomes if of.admits(o)}
            assert got_outcomes <= admitted_outcomes
            if plan == "exact":
                assert got_outcomes == admitted_outcomes
            checked += 1
    assert checked >= 15, checked
    assert refused >= 5, refused


@pytest.mark.smoke
async def test_row_level_security_admits_one_tenant_whatever_the_query(database: str) -> None:
    await seed(database, random.Random(7))
    conn = await asyncpg.connect(database)
    try:
        async with conn.transaction():
            await conn.execute("SET LOCAL ROLE alma_reader")
            await conn.execute("SELECT set_config('alma.tenant_id', 't1', true)")
            tenants = {r[0] for r in await conn.fetch("SELECT tenant_id FROM memories")}
            assert tenants == {"t1"}
            outcome_tenants = await conn.fetch("SELECT DISTINCT tenant_id FROM workflow_outcomes")
            assert [r[0] for r in outcome_tenants] == ["t1"]
        async with conn.transaction():
            await conn.execute("SET LOCAL ROLE alma_reader")  # no tenant set: nothing
            assert await conn.fetchval("SELECT count(*) FROM memories") == 0
        async with conn.transaction():
            await conn.execute("SET LOCAL ROLE alma_reader")  # read only: no writes at all
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("DELETE FROM memories")
    finally:
        await conn.close()


async def test_retrieval_transactions_read_as_the_reader_role_of_one_tenant(
    database: str,
) -> None:
    """What Retriever sets for its read transaction: the alma_reader role and the
    tenant, for that transaction only (the HNSW settings too)."""
    await seed(database, random.Random(5))
    conn = await asyncpg.connect(database)
    try:
        owner = await conn.fetchval("SELECT current_user")
        f = scopes.memory_filter(WorkflowContext("t2"), RetrievalScope.TENANT, require_tenant=True)
        async with conn.transaction(readonly=True):
            await retrieval._as_reader(conn, f)
            await retrieval._approximate(conn, 77)
            assert await conn.fetchval("SELECT current_user") == "alma_reader"
            tenants = {r[0] for r in await conn.fetch("SELECT tenant_id FROM memories")}
            assert tenants == {"t2"}, "row-level security with the tenant set"
            assert await conn.fetchval("SHOW hnsw.ef_search") == "77"
            assert await conn.fetchval("SHOW hnsw.iterative_scan") == "relaxed_order"
        assert await conn.fetchval("SELECT current_user") == owner, "local to the transaction"
        assert await conn.fetchval("SELECT current_setting('alma.tenant_id', true)") in ("", None)
    finally:
        await conn.close()


async def test_a_pooled_connection_comes_back_as_it_went(
    database: str, embedder: AsyncEmbedder
) -> None:
    """The pool sends no reset query on release (a round trip saved per use): what a
    retrieval sets (the reader role, the tenant, the HNSW and plan settings) ends with
    its transaction, and so does one left mid-transaction (the pool rolls it back)."""
    await seed(database, random.Random(6))
    session = """SELECT current_user, coalesce(current_setting('alma.tenant_id', true), ''),
                        current_setting('plan_cache_mode'), current_setting('hnsw.ef_search'),
                        pg_current_xact_id_if_assigned() IS NULL"""
    async with connect(database, min_size=1, max_size=1) as pool:
        await pool.fetchval("SELECT '[1]'::vector IS NOT NULL")  # defines hnsw.*
        before = tuple(await pool.fetchrow(session))
        retriever = Retriever(pool, embedder, require_tenant=True, ef_search=77)
        ctx = WorkflowContext("t1")
        for plan in ("approximate", "exact"):
            found = await retriever.retrieve("anything", ctx, RetrievalScope.TENANT, plan=plan)
            assert found.items(), plan
            assert tuple(await pool.fetchrow(session)) == before, plan
        f = scopes.memory_filter(ctx, RetrievalScope.TENANT, require_tenant=True)
        async with pool.acquire() as conn:  # a search left mid-transaction (cancelled)
            await conn.transaction(readonly=True).start()
            await retrieval._as_reader(conn, f)
            await retrieval._approximate(conn, 77)
        assert tuple(await pool.fetchrow(session)) == before, "after a search left open"
        assert await pool.fetchval("SELECT count(*) FROM memories") == 400, "the owner's view"


async def test_global_scope_only_in_single_tenant_mode(
    database: str, embedder: AsyncEmbedder
) -> None:
    await seed(database, random.Random(3))
    ctx = WorkflowContext("t0", "w0")
    async with connect(database) as pool:
        with pytest.raises(errors.ContextError, match="multi-tenant"):
            await Retriever(pool, embedder).retrieve("x", ctx, RetrievalScope.GLOBAL)
        found = await Retriever(pool, embedder, require_tenant=False).retrieve(
            "x", ctx, RetrievalScope.GLOBAL, top_k=1000, include_workflow_outcomes=False
        )
    assert {m.tenant_id for m in found.items()} == set(TENANTS)
    assert 0 < estimate_tokens(found.to_prompt(max_tokens=50)) <= 50


def cosine_distance(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return 1 - dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


async def test_tenant_and_agent_scopes_rank_by_half_copies_as_by_full_vectors(
    database: str,
) -> None:
    """The exact plan for a tenant or agent scope orders candidates by the embeddings'
    half-precision copies: per kind it returns the nearest rows by the full vectors,
    up to ties closer than half precision tells apart, with full-precision distances."""
    rng = random.Random(11)
    memories, _ = await seed(database, rng)
    conn = await asyncpg.connect(database)
    try:
        stored = {
            str(r["id"]): [float(x) for x in r["embedding"][1:-1].split(",")]
            for r in await conn.fetch("SELECT id, embedding::text AS embedding FROM memories")
        }
        for tenant, agent in [("t0", None), ("t1", "a0"), ("t2", "a1")]:
            scope = RetrievalScope.AGENT if agent else RetrievalScope.TENANT
            f = scopes.memory_filter(WorkflowContext(tenant), scope, agent=agent)
            query = unit_vector(rng)
            sql, args = retrieval.nearest_query("memories", "exact", vector_literal(query), f, 4)
            async with conn.transaction(readonly=True):
                await retrieval._as_reader(conn, f)
                rows = await conn.fetch(sql, *args)
            for kind in KINDS:
                admitted = [m["id"] for m in memories if f.admits(m) and m["kind"] == kind]
                truth = sorted(cosine_distance(query, stored[i]) for i in admitted)
                got = [r for r in rows if r["kind"] == kind]
                assert len(got) == min(4, len(admitted)), (tenant, agent, kind)
                for r in got:
                    full = cosine_distance(query, stored[str(r["id"])])
                    assert r["distance"] == pytest.approx(full, abs=1e-6), "full precision"
                    assert full <= truth[len(got) - 1] + 2e-3, "one of the nearest"
    finally:
        await conn.close()


async def test_tenant_and_agent_scopes_are_searched_from_the_index_alone(database: str) -> None:
    """memories_vectors covers the broad scopes' exact search: an index-only scan,
    no table page read for the rows in scope (the cost that grew with the tenant)."""
    rng = random.Random(13)
    await seed(database, rng)
    conn = await asyncpg.connect(database)
    try:
        # What autovacuum does in time: pages all-visible (the test server commits
        # asynchronously; VACUUM marks a page only once the inserts' WAL is flushed).
        await conn.execute("CHECKPOINT")
        await conn.execute("VACUUM ANALYZE memories")  # and statistics: one plan, every run
        for scope, agent in [(RetrievalScope.TENANT, None), (RetrievalScope.AGENT, "a1")]:
            f = scopes.memory_filter(WorkflowContext("t1"), scope, agent=agent)
            sql, args = retrieval.nearest_query(
                "memories", "exact", vector_literal(unit_vector(rng)), f, 5
            )
            async with conn.transaction(readonly=True):
                await retrieval._as_reader(conn, f)
                await conn.execute("SET LOCAL enable_seqscan = off")  # 400 rows: tiny
                plan = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
            nodes = list(plan_nodes(json.loads(plan)[0]["Plan"]))
            scans = [n for n in nodes if n.get("Index Name") == "memories_vectors"]
            assert scans, [(n["Node Type"], n.get("Index Name")) for n in nodes]
            assert all(n["Node Type"] == "Index Only Scan" for n in scans)
            assert sum(n.get("Heap Fetches", 0) for n in scans) == 0
            assert "current_setting" not in json.dumps(scans), "row-level security read once"
    finally:
        await conn.close()


async def analyze(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("ANALYZE memories, workflow_outcomes")
    finally:
        await conn.close()


async def test_the_plan_follows_estimates_that_know_workflows_belong_to_tenants(
    database: str, embedder: AsyncEmbedder
) -> None:
    """The plan is chosen from the planner's estimate, and the estimate of a workflow
    scope knows a workflow id belongs to one tenant (0010's dependency statistics).
    Without them the planner multiplies the two columns' selectivities: a third of
    the table in tenant t0, a fifth in its big workflow, so 1/15 of 1,500 rows = 100
    estimated for the 300 there are, and a limit of 200 would keep the exact plan."""
    rng = random.Random(23)
    rows = [("t0", "t0-big")] * 300 + [
        (t, f"{t}-w{i}") for t in TENANTS for i in range(40) for _ in range(10)
    ][:1200]
    conn = await asyncpg.connect(database)
    try:
        await conn.executemany(
            """INSERT INTO memories (id, tenant_id, kind, workflow_id, content, dedupe_key,
                   confidence, embedding)
               VALUES (gen_random_uuid(), $1, 'heuristic', $2, 'a memory',
                       gen_random_uuid()::text, 0.5, $3::vector)""",
            [(t, w, vector_literal(unit_vector(rng))) for t, w in rows],
        )
        await conn.execute("ANALYZE memories, workflow_outcomes")
        independent = (
            await conn.fetchval("SELECT count(*) FROM memories WHERE tenant_id = 't0'")
            * await conn.fetchval("SELECT count(*) FROM memories WHERE workflow_id = 't0-big'")
            / len(rows)
        )
    finally:
        await conn.close()
    assert independent < 200 < 300, "the product of selectivities would stay under the limit"
    async with connect(database) as pool:
        retriever = Retriever(pool, embedder, exact_max_rows=200, index_exact_max_rows=10_000)
        big = await retriever.retrieve("x", WorkflowContext("t0", "t0-big"), top_k=3)
        small = await retriever.retrieve("x", WorkflowContext("t0", "t0-w1"), top_k=3)
        tenant = await retriever.retrieve("x", WorkflowContext("t1"), RetrievalScope.TENANT)
    assert (big.plan, small.plan, tenant.plan) == ("approximate", "exact", "exact")


async def test_full_vectors_stay_in_the_row(database: str) -> None:
    """The half copy goes out of line, the full vector stays in the row: with both in
    line a row passes the toast threshold and PostgreSQL would move the full vector
    out, adding a TOAST read to every plan that scores by it."""
    await seed(database, random.Random(17))
    conn = await asyncpg.connect(database)
    try:
        # Read from the table's TOAST relation, as any PostgreSQL allows
        # (pg_column_toast_chunk_id, which names the column, is 17's): each value out of
        # line is one chunk_id, and its bytes say whose it is: a half copy's 772, a full
        # vector's 1,540.
        toast = await conn.fetchval(
            "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'memories'::regclass"
        )
        values, largest = await conn.fetchrow(
            f"SELECT count(DISTINCT chunk_id), max(length(chunk_data)) FROM {toast}"
        )
        assert await conn.fetchval("SELECT count(*) FROM memories") == 400
        assert (values, largest) == (400, 772)  # each row's half copy; no full vector
    finally:
        await conn.close()


async def test_each_scope_is_planned_against_its_own_limit(
    database: str, embedder: AsyncEmbedder
) -> None:
    """Scopes read from the table switch to HNSW past ``exact_max_rows``; tenant and
    agent scopes, read from the covering index, past ``index_exact_max_rows``."""
    memories, _ = await seed(database, random.Random(19))
    await analyze(database)  # the plan follows the statistics (400 rows: all read)
    tenant = [m for m in memories if m["tenant_id"] == "t0"]
    workflow = [m for m in tenant if m["workflow_id"] == "w0"]
    assert len(workflow) > 10
    assert len(tenant) < 1000
    ctx = WorkflowContext("t0", "w0")
    async with connect(database) as pool:
        retriever = Retriever(pool, embedder, exact_max_rows=10, index_exact_max_rows=1000)
        plans = {
            scope: (await retriever.retrieve("x", ctx, scope, agent="a0")).plan
            for scope in (RetrievalScope.WORKFLOW, RetrievalScope.AGENT, RetrievalScope.TENANT)
        }
        assert plans == {
            RetrievalScope.WORKFLOW: "approximate",
            RetrievalScope.AGENT: "exact",
            RetrievalScope.TENANT: "exact",
        }
        small = Retriever(pool, embedder, exact_max_rows=10, index_exact_max_rows=10)
        assert (await small.retrieve("x", ctx, RetrievalScope.TENANT)).plan == "approximate"


async def test_a_scope_plan_is_reused_for_a_while(database: str, embedder: AsyncEmbedder) -> None:
    """A retriever probes a scope's estimate once per ``plan_ttl_s``: asked again
    within it, the scope keeps its plan even after it grew and ANALYZE ran; past it
    (here 0 s), the new estimate decides."""
    rng = random.Random(19)
    memories, _ = await seed(database, rng)
    await analyze(database)
    ctx = WorkflowContext("t0", "w0")
    assert len([m for m in memories if m["tenant_id"] == "t0" and m["workflow_id"] == "w0"]) < 100
    async with connect(database) as pool:
        kept = Retriever(pool, embedder, exact_max_rows=100)
        probing = Retriever(pool, embedder, exact_max_rows=100, plan_ttl_s=0)
        assert (await kept.retrieve("x", ctx)).plan == "exact"
        assert (await probing.retrieve("x", ctx)).plan == "exact"
        await pool.executemany(
            """INSERT INTO memories (id, tenant_id, kind, workflow_id, content, dedupe_key,
                   confidence, embedding)
               VALUES (gen_random_uuid(), 't0', 'heuristic', 'w0', 'a memory',
                       gen_random_uuid()::text, 0.5, $1::vector)""",
            [(vector_literal(unit_vector(rng)),) for _ in range(400)],
        )
        await analyze(database)
        assert (await kept.retrieve("x", ctx)).plan == "exact", "reused"
        assert (await probing.retrieve("x", ctx)).plan == "approximate", "probed again"


def as_found(found: Any) -> list[tuple[str, str, Any]]:
    """A slice as (section, id, score), in the order it lists them (the score up to
    its recency, which moves with the clock between two searches)."""
    return [
        (section, x.id, pytest.approx(x.score, abs=1e-6))
        for section in (*retrieval.SLICE_KINDS.values(), "workflow_outcomes")
        for x in getattr(found, section)
    ]


async def test_a_search_split_over_connections_finds_what_one_finds(
    database: str, embedder: AsyncEmbedder
) -> None:
    """Tenant and agent scopes (exact, from the covering index) and HNSW searches are
    split by kind over ``fanout`` connections: the slice is the one a single search
    gives, item for item and score for score, at every fan-out."""
    await seed(database, random.Random(23))
    await analyze(database)
    cases = [
        (WorkflowContext("t0"), RetrievalScope.TENANT, None, None),
        (WorkflowContext("t1"), RetrievalScope.AGENT, "a0", None),
        (WorkflowContext("t2"), RetrievalScope.TENANT, None, "approximate"),
        (WorkflowContext("t0", "w1"), RetrievalScope.WORKFLOW, None, "approximate"),
        (WorkflowContext("t1", "w2"), RetrievalScope.WORKFLOW, None, "exact"),
    ]
    async with connect(database) as pool:
        by_fanout = {
            n: Retriever(pool, embedder, fanout=n, fanout_min_rows=0) for n in (1, 2, 3, 5)
        }
        for ctx, scope, agent, plan in cases:
            found = {
                n: await r.retrieve("a task", ctx, scope, agent=agent, top_k=4, plan=plan)
                for n, r in by_fanout.items()
            }
            one = as_found(found[1])
            assert len({m.kind for m in found[1].items() if isinstance(m, Memory)}) == 5
            for n, slice_ in found.items():
                assert as_found(slice_) == one, (scope, plan, n)
                assert slice_.plan == found[1].plan


async def test_retrievals_split_over_connections_share_a_small_pool(
    database: str, embedder: AsyncEmbedder
) -> None:
    """A retrieval never holds a connection while it waits for another: many at once,
    each wanting six connections (and a probe of the scope's size each), finish on a
    pool of two (bounded: 60 s)."""
    await seed(database, random.Random(29))
    await analyze(database)
    async with connect(database, max_size=2) as pool:
        retriever = Retriever(pool, embedder, fanout=5, fanout_min_rows=0, plan_ttl_s=0)
        tenant = WorkflowContext("t1"), RetrievalScope.TENANT
        alone = as_found(await retriever.retrieve("a task", *tenant))
        at_once = await asyncio.wait_for(
            asyncio.gather(*(retriever.retrieve("a task", *tenant) for _ in range(12))),
            timeout=60,
        )
    assert [as_found(x) for x in at_once] == [alone] * 12


async def test_only_a_large_scope_is_split_over_connections(
    database: str, embedder: AsyncEmbedder
) -> None:
    """A scope the planner estimates under ``fanout_min_rows`` is searched on one
    connection (its scans cost what more round trips would save), a larger one on
    ``fanout``: the connections a fresh pool had to open for the retrieval tell (its
    searches start at once, each on a connection of its own, and one more searches
    the outcomes)."""
    await seed(database, random.Random(31))
    await analyze(database)
    tenant = WorkflowContext("t0"), RetrievalScope.TENANT
    for min_rows, searches in ((1_000_000, 1), (0, 5)):
        async with connect(database, max_size=8) as pool:
            retriever = Retriever(pool, embedder, fanout=5, fanout_min_rows=min_rows)
            found = await retriever.retrieve("a task", *tenant, top_k=2)
            assert pool.get_size() == searches + 1, (min_rows, pool.get_size())
        assert len({m.kind for m in found.items() if isinstance(m, Memory)}) == 5
