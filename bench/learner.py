"""Learner and retrieval benchmark: outcomes stored per second with embeddings, outcome
save latency, and scoped retrieval (p50/p95, recall@10 of the approximate plan against
exact) at 100k and 1M memories.

    python -m bench.learner [--quick] [--sizes 100000,1000000] [--out docs/benchmarks.md]

Runs on a fresh embedded stack (durable PostgreSQL) in a temporary directory. The
outcome part runs the real pipeline (checkpointer + learner worker with the bundled
all-MiniLM-L6-v2 model). The retrieval part bulk-loads synthetic memories whose
vectors are clustered (like real embeddings, unlike uniform noise), builds the HNSW
indexes after the load, and queries with vectors planted for the query texts, so it
times the database side; the model's cost for one query text is measured apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import numpy as np
from aiokafka import AIOKafkaProducer
from pgvector.asyncpg import register_vector
from rich.progress import Progress

from alma_core import scopes
from alma_core import settings as settings_mod
from alma_core.cli.topics import ensure_topics
from alma_core.consumers import learner
from alma_core.consumers.worker import Services, run_worker
from alma_core.storage import offsets
from alma_core.storage.embeddings import AsyncEmbedder, Vector, load_embedder
from alma_core.storage.postgres import connect
from alma_core.storage.retrieval import Retriever
from alma_core.types import RetrievalScope, WorkflowContext
from bench.env import CODEC, PARTITIONS, stack
from bench.report import console, ms, report

DIM = 384
TENANTS = 50
WORKFLOWS = 10  # per tenant
AGENTS = 5  # per tenant
RUN_ROWS = 20  # memories per run
NODES = 5  # per run
KINDS = (
    ["outcome"] * 4 + ["heuristic"] * 2 + ["domain_knowledge"] * 2 + ["anti_pattern", "preference"]
)
TOPICS = 1000  # cluster centres
SPREAD = 0.6  # noise around a centre: cosine to it ≈ 0.86
PLANS = ("auto", "exact", "approximate")
SCOPES = [
    RetrievalScope.NODE,
    RetrievalScope.RUN,
    RetrievalScope.WORKFLOW,
    RetrievalScope.AGENT,
    RetrievalScope.TENANT,
]
TASKS = [
    "summarise the quarterly revenue report",
    "extract entities from the contract",
    "translate the support ticket",
    "classify the invoice",
    "draft a reply to the customer",
    "plan the data migration",
    "review the pull request",
    "answer the policy question",
]


# -- outcomes stored with embeddings (the real pipeline) ------------------------------


class TimedLearnHandler(learner.LearnHandler):
    """Records each completion's time from ``emitted_at`` to durable, and batch times."""

    done: ClassVar[list[float]] = []
    batches: ClassVar[list[tuple[int, float]]] = []

    async def handle(
        self,
        cluster_id: str,
        batch: dict[Any, list[Any]],
        read_from: dict[Any, int] | None = None,
    ) -> offsets.Progress:
        started = time.perf_counter()
        result = await super().handle(cluster_id, batch, read_from)
        now = datetime.now(UTC)
        completions = 0
        for records in batch.values():
            for r in records:
                doc = json.loads(r.value)
                if doc.get("type") == "workflow.completed":
                    completions += 1
                    self.done.append(
                        (now - datetime.fromisoformat(doc["emitted_at"])).total_seconds()
                    )
        if completions:
            self.batches.append((completions, time.perf_counter() - started))
        return result


def run_events(run: str, i: int) -> list[dict[str, Any]]:
    """Three nodes and the completion of one run; every task text is new."""
    base = {"tenant_id": f"t{i % 5}", "workflow_id": f"wf{i % 7}", "run_id": run}
    failed = i % 4 == 0
    events = []
    for n in range(3):
        updates = {"step": n, "notes": f"step {n} of {run}"}
        events.append(
            {
                **base,
                "type": "node.completed",
                "node_id": f"step{n}",
                "payload": {"updates": updates},
            }
        )
    error = f"timeout calling service {i % 3} after 30s"
    if failed:
        events[-1]["type"] = "node.failed"
        events[-1]["payload"]["error"] = {"type": "TimeoutError", "message": error}
    events.append(
        {
            **base,
            "type": "workflow.completed",
            "payload": {
                "outcome": "failure" if failed else "success",
                "duration_ms": 1200 + i,
                "node_count": 3,
                "nodes_succeeded": 2 if failed else 3,
                "nodes_failed": int(failed),
                "error_message": error if failed else None,
                "task": f"{TASKS[i % len(TASKS)]} for {run}",
            },
        }
    )
    for e in events:
        e["event_id"] = uuid.uuid4().hex
    return events


async def publish(bootstrap: str, topic: str, runs: int, rate: float | None, tag: str) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, compression_type=CODEC
    )
    await producer.start()
    started = time.perf_counter()
    try:
        for i in range(runs):
            if rate is not None:
                delay = started + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            for e in run_events(f"{tag}-{i}", i):
                e["emitted_at"] = datetime.now(UTC).isoformat()
                await producer.send(topic, json.dumps(e).encode(), key=e["run_id"].encode())
        await producer.flush()
    finally:
        await producer.stop()


async def outcomes(
    s: settings_mod.Settings,
    services: Services,
    embedder: AsyncEmbedder,
    runs: int,
    rate: float | None,
    learner_alone: bool = False,
) -> dict[str, Any]:
    """``runs`` runs through checkpointer and learner; offered at ``rate`` runs/s, or
    all at once (a backlog) when ``rate`` is None. ``learner_alone``: the checkpointer
    hands every completion on first, then the learner starts on them (a learner that
    was down, or scaled apart: its backlog without the checkpointer beside it)."""
    topic = f"bench-learn-{uuid.uuid4().hex[:8]}"
    await ensure_topics(services.kafka_bootstrap, [topic], partitions=PARTITIONS)
    s = s.model_copy(update={"lifecycle_topic": topic})
    TimedLearnHandler.done, TimedLearnHandler.batches = [], []
    async with connect(services.postgres_dsn) as pool:
        before = await pool.fetchval("SELECT count(*) FROM workflow_outcomes")
        consumers = ["checkpoint", "learn"]
        if rate is None:
            await publish(services.kafka_bootstrap, topic, runs, None, topic)
        if learner_alone:
            await checkpointed_first(s, services, pool, topic, runs)
            consumers = ["learn"]
        original = learner.LearnHandler
        learner.LearnHandler = TimedLearnHandler  # type: ignore[misc]
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(
            run_worker(s, services, consumers, stop, ready=ready, embedder=embedder)
        )
        try:
            await asyncio.wait_for(ready.wait(), 120)
        finally:
            learner.LearnHandler = original  # type: ignore[misc]
        encoded_before = embedder.encoded
        started = time.perf_counter()
        paced = None
        if rate is not None:
            paced = asyncio.create_task(publish(services.kafka_bootstrap, topic, runs, rate, topic))
        first = None
        while time.perf_counter() - started < 600:
            stored = await pool.fetchval("SELECT count(*) FROM workflow_outcomes") - before
            if stored and first is None:
                first = time.perf_counter()
            if stored >= runs:
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - (first or started)
        if paced is not None:
            await paced
        stop.set()
        await task
        memories = await pool.fetchval(
            "SELECT count(*) FROM memories WHERE run_id LIKE $1", f"{topic}-%"
        )
    per_outcome = [seconds for n, seconds in TimedLearnHandler.batches for _ in range(n)]
    busy = sum(seconds for _, seconds in TimedLearnHandler.batches)
    return {
        "runs": runs,
        "stored": stored,
        "rate": stored / elapsed,
        "capacity": stored / busy if busy else float("nan"),
        "e2e": TimedLearnHandler.done,
        "save": per_outcome,
        "batch": [n for n, _ in TimedLearnHandler.batches],
        "encoded": embedder.encoded - encoded_before,
        "memories": memories,
    }


async def checkpointed_first(
    s: settings_mod.Settings, services: Services, pool: asyncpg.Pool, topic: str, runs: int
) -> None:
    """Run the checkpointer alone until every run's completion is handed on."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(s, services, ["checkpoint"], stop))
    try:
        started = time.perf_counter()
        while time.perf_counter() - started < 300:
            completed = await pool.fetchval(
                "SELECT count(*) FROM run_events WHERE type = 'workflow.completed' "
                "AND run_id LIKE $1",
                f"{topic}-%",
            )
            pending = await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            if completed >= runs and not pending:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the checkpointer handed on {completed} of {runs} completions in 300 s")
    finally:
        stop.set()
        await task


# -- scoped retrieval at scale (synthetic clustered vectors, bulk-loaded) -------------


def centres(rng: np.random.Generator) -> np.ndarray:
    c = rng.standard_normal((TOPICS, DIM)).astype(np.float32)
    return c / np.linalg.norm(c, axis=1, keepdims=True)


def around(rng: np.random.Generator, c: np.ndarray, topics: np.ndarray) -> np.ndarray:
    noise = rng.standard_normal((len(topics), DIM)).astype(np.float32)
    v = c[topics] + SPREAD * noise / np.linalg.norm(noise, axis=1, keepdims=True)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def coords(row: int, total: int) -> tuple[str, str, str, str, str]:
    """Tenant, workflow, run, node and agent of row ``row`` of ``total`` (deterministic,
    so queries can pick real contexts without reading them back)."""
    per_wf = total // (TENANTS * WORKFLOWS)
    wf_global, within = divmod(row, per_wf)
    t, w = divmod(wf_global % (TENANTS * WORKFLOWS), WORKFLOWS)
    r = within // RUN_ROWS
    return (
        f"t{t}",
        f"t{t}-w{w}",
        f"t{t}-w{w}-r{r}",
        f"n{within % NODES}",
        f"agent{(row // 7) % AGENTS}",
    )


def memory_rows(
    start: int, stop: int, total: int, c: np.ndarray, rng: np.random.Generator
) -> Iterator[tuple[Any, ...]]:
    vectors = around(rng, c, rng.integers(0, TOPICS, stop - start))
    now = datetime.now(UTC)
    for i, row in enumerate(range(start, stop)):
        tenant, wf, run, node, agent = coords(row, total)
        kind = KINDS[row % len(KINDS)]
        occ = int(rng.integers(1, 20))
        yield (
            uuid.uuid4(),
            tenant,
            kind,
            agent,
            wf,
            run,
            node,
            f"memory {row} of {run}",
            f"k{row}",
            occ,
            int(rng.integers(0, occ + 1)),
            float(rng.random()),
            vectors[i],
            now - timedelta(days=float(rng.random() * 90)),
        )


MEMORY_COLUMNS = [
    "id",
    "tenant_id",
    "kind",
    "agent",
    "workflow_id",
    "run_id",
    "node_id",
    "content",
    "dedupe_key",
    "occurrences",
    "successes",
    "confidence",
    "embedding",
    "created_at",
]
OUTCOME_COLUMNS = [
    "id",
    "tenant_id",
    "workflow_id",
    "run_id",
    "event_id",
    "success",
    "duration_ms",
    "node_count",
    "nodes_succeeded",
    "nodes_failed",
    "task",
    "description",
    "embedding",
    "created_at",
]


def outcome_rows(
    start: int, stop: int, total: int, c: np.ndarray, rng: np.random.Generator
) -> Iterator[tuple[Any, ...]]:
    """One outcome per run (``RUN_ROWS`` memories), for the rows in [start, stop)."""
    vectors = around(rng, c, rng.integers(0, TOPICS, stop - start))
    now = datetime.now(UTC)
    for i, row in enumerate(range(start, stop)):
        tenant, wf, run, _, _ = coords(row * RUN_ROWS, total)
        ok = bool(rng.random() < 0.8)
        yield (
            uuid.uuid4(),
            tenant,
            wf,
            run,
            f"bench-{uuid.uuid4().hex}",
            ok,
            1000,
            5,
            5 if ok else 4,
            0 if ok else 1,
            f"task of {run}",
            f"outcome of {run}",
            vectors[i],
            now - timedelta(days=float(rng.random() * 90)),
        )


async def load(
    dsn: str, total: int, c: np.ndarray, seed: int, progress: Progress
) -> dict[str, float]:
    """Fill the tables with ``total`` memories and one outcome per run: indexes
    dropped, COPY, indexes built after (HNSW inserts are ~100× slower)."""
    conn = await asyncpg.connect(dsn)
    await register_vector(conn)
    timings: dict[str, float] = {}
    try:
        await conn.execute("TRUNCATE memories, workflow_outcomes, artifact_links")
        await conn.execute(
            "DROP INDEX IF EXISTS memories_embedding_hnsw, workflow_outcomes_embedding_hnsw"
        )
        rng = np.random.default_rng(seed)
        task = progress.add_task(f"load {total:,} memories", total=total + total // RUN_ROWS)
        started = time.perf_counter()
        chunk = 50_000
        for lo in range(0, total, chunk):
            hi = min(total, lo + chunk)
            await conn.copy_records_to_table(
                "memories", records=memory_rows(lo, hi, total, c, rng), columns=MEMORY_COLUMNS
            )
            progress.advance(task, hi - lo)
        runs = total // RUN_ROWS
        for lo in range(0, runs, chunk):
            hi = min(runs, lo + chunk)
            await conn.copy_records_to_table(
                "workflow_outcomes",
                records=outcome_rows(lo, hi, total, c, rng),
                columns=OUTCOME_COLUMNS,
            )
            progress.advance(task, hi - lo)
        timings["copy"] = time.perf_counter() - started
        progress.update(task, description=f"HNSW index on {total:,} memories")
        await conn.execute("SET maintenance_work_mem = '6GB'")
        await conn.execute("SET max_parallel_maintenance_workers = 1")
        started = time.perf_counter()
        await conn.execute(
            "CREATE INDEX memories_embedding_hnsw ON memories "
            "USING hnsw (embedding vector_cosine_ops)"
        )
        timings["hnsw"] = time.perf_counter() - started
        await conn.execute(
            "CREATE INDEX workflow_outcomes_embedding_hnsw ON workflow_outcomes "
            "USING hnsw (embedding vector_cosine_ops)"
        )
        await conn.execute("VACUUM ANALYZE memories")
        await conn.execute("VACUUM ANALYZE workflow_outcomes")
        timings["size_mb"] = await conn.fetchval(
            "SELECT pg_relation_size('memories_embedding_hnsw') / 1e6"
        )
        progress.remove_task(task)
    finally:
        await conn.close()
    return timings


class PlantedEmbedder:
    """Query texts ``q<i>`` map to vectors chosen by the benchmark (database-side timing)."""

    name = "planted"
    dimension = DIM

    def __init__(self) -> None:
        self.vectors: dict[str, Vector] = {}

    def encode(self, texts: list[str]) -> list[Vector]:
        return [self.vectors[t] for t in texts]


def context_for(scope: RetrievalScope, row: int, total: int) -> tuple[WorkflowContext, str]:
    tenant, wf, run, node, agent = coords(row, total)
    if scope is RetrievalScope.NODE:
        return WorkflowContext(tenant_id=tenant, workflow_id=wf, run_id=run, node_id=node), agent
    if scope is RetrievalScope.RUN:
        return WorkflowContext(tenant_id=tenant, workflow_id=wf, run_id=run), agent
    if scope is RetrievalScope.WORKFLOW:
        return WorkflowContext(tenant_id=tenant, workflow_id=wf), agent
    return WorkflowContext(tenant_id=tenant), agent


def ids(result: Any) -> set[str]:
    return {m.id for m in result.items()} | {o.id for o in result.workflow_outcomes}


async def retrieval(
    dsn: str, total: int, c: np.ndarray, queries: int, seed: int
) -> list[list[str]]:
    planted = PlantedEmbedder()
    embedder = AsyncEmbedder(planted, cache_size=0)
    rng = np.random.default_rng(seed + 1)
    pick = random.Random(seed)
    rows: list[list[str]] = []
    async with connect(dsn) as pool:
        retriever = Retriever(pool, embedder, require_tenant=True)
        for scope in SCOPES:
            timings: dict[str, list[float]] = {
                "first": [],
                "auto": [],
                "exact": [],
                "approximate": [],
            }
            recalls: list[float] = []
            plans: set[str] = set()
            vectors = around(rng, c, rng.integers(0, TOPICS, queries))
            for q in range(queries):
                text = f"q{q}"
                planted.vectors[text] = [float(x) for x in vectors[q]]
                ctx, agent = context_for(scope, pick.randrange(total), total)
                kw = {"agent": agent if scope is RetrievalScope.AGENT else None, "top_k": 10}
                got = {}
                # the context's first query pays for its pages missing from shared
                # buffers; the plans are then compared on the same, warm pages, each
                # first in turn
                plans_in_turn = PLANS[q % 3 :] + PLANS[: q % 3]
                for plan in ("first", *plans_in_turn):
                    t = time.perf_counter()
                    got[plan] = await retriever.retrieve(
                        text, ctx, scope, plan=plan if plan in PLANS[1:] else None, **kw
                    )
                    timings[plan].append(time.perf_counter() - t)
                plans.add(got["auto"].plan)
                exact = ids(got["exact"])
                if exact:
                    recalls.append(len(exact & ids(got["approximate"])) / len(exact))
            size = await scope_size(pool, scope, ctx, kw["agent"])
            rows.append(
                [
                    f"{total:,}",
                    scope.value,
                    f"{size:,}",
                    "/".join(sorted(plans)),
                    ms(timings["first"], 50),
                    ms(timings["first"], 95),
                    ms(timings["auto"], 50),
                    ms(timings["auto"], 95),
                    ms(timings["exact"], 50),
                    ms(timings["exact"], 95),
                    ms(timings["approximate"], 50),
                    ms(timings["approximate"], 95),
                    f"{sum(recalls) / max(1, len(recalls)):.3f}",
                ]
            )
    return rows


async def scope_size(
    pool: asyncpg.Pool, scope: RetrievalScope, ctx: WorkflowContext, agent: str | None
) -> int:
    """Memories the scope admits for the last context queried (sizes are uniform)."""
    f = scopes.memory_filter(ctx, scope, agent=agent, require_tenant=True)
    where, args = f.sql(1)
    return int(await pool.fetchval(f"SELECT count(*) FROM memories WHERE {where}", *args))


async def query_embedding(embedder: AsyncEmbedder, samples: int) -> list[float]:
    """The model's time for one new query text (batch of one, cache missed)."""
    out = []
    for i in range(samples):
        t = time.perf_counter()
        await embedder.embed([f"{TASKS[i % len(TASKS)]}: query {i} {uuid.uuid4().hex}"])
        out.append(time.perf_counter() - t)
    return out


async def main(quick: bool, sizes: list[int], out: Path | None) -> None:
    rows: dict[str, list[list[str]]] = {"outcomes": [], "retrieval": [], "load": []}
    c = centres(np.random.default_rng(7))
    with Progress(console=console) as progress:
        async with stack(quick, 1, False, progress) as env:
            s, services, task = env.s, env.services, env.task
            progress.update(task, description="loading the embedding model", total=4 + len(sizes))
            embedder = await asyncio.to_thread(load_embedder, s)
            progress.update(task, description="benchmarks")
            try:
                backlog = 60 if quick else 400
                for label, runs, rate, alone in (
                    ("backlog", backlog, None, False),
                    ("backlog, learner alone", backlog, None, True),
                    ("5 runs/s", 30 if quick else 100, 5.0, False),
                    ("20 runs/s", 60 if quick else 300, 20.0, False),
                ):
                    r = await outcomes(s, services, embedder, runs, rate, alone)
                    e2e = [ms(r["e2e"], 50), ms(r["e2e"], 95)] if rate else ["—", "—"]
                    rows["outcomes"].append(
                        [
                            label,
                            r["stored"],
                            f"{r['capacity']:.1f}",
                            f"{np.mean(r['batch']):.1f}",
                            ms(r["save"], 50),
                            ms(r["save"], 95),
                            *e2e,
                            r["encoded"],
                            r["memories"],
                        ]
                    )
                    progress.advance(task)
                q = await query_embedding(embedder, 30 if quick else 100)
                rows["query"] = [["model, one query text", ms(q, 50), ms(q, 95)]]
                for total in sizes:
                    dsn = services.postgres_dsn
                    timings = await load(dsn, total, c, 11, progress)
                    copy_rate = total / timings["copy"]
                    rows["load"].append(
                        [
                            f"{total:,}",
                            f"{total // RUN_ROWS:,}",
                            f"{copy_rate:,.0f}",
                            f"{timings['hnsw']:.0f}",
                            f"{timings['size_mb']:.0f}",
                        ]
                    )
                    rows["retrieval"] += await retrieval(dsn, total, c, 30 if quick else 100, 11)
                    progress.advance(task)
            finally:
                embedder.close()
    report("learner", rows, HEADERS, TITLES, out)


HEADERS = {
    "outcomes": [
        "offered",
        "outcomes",
        "learner outcomes/s busy",
        "completions per batch",
        "save p50 ms",
        "save p95 ms",
        "e2e p50 ms",
        "e2e p95 ms",
        "texts embedded",
        "node memories",
    ],
    "load": ["memories", "outcomes", "COPY rows/s", "HNSW build s", "HNSW index MB"],
    "retrieval": [
        "memories",
        "scope",
        "rows in scope",
        "auto plan",
        "first query p50 ms",
        "first query p95 ms",
        "auto p50 ms",
        "auto p95 ms",
        "exact p50 ms",
        "exact p95 ms",
        "approx. p50 ms",
        "approx. p95 ms",
        "approx. recall@10",
    ],
    "query": ["step", "p50 ms", "p95 ms"],
}
TITLES = {
    "outcomes": "Outcomes stored with embeddings (checkpointer + learner, one process each way)",
    "load": "Bulk load of synthetic memories (indexes built after)",
    "retrieval": "Scoped retrieval, database side (top_k=10 per kind, memories and outcomes)",
    "query": "Embedding the query text",
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default=None, help="memory counts, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    default = "20000" if args.quick else "100000,1000000"
    asyncio.run(main(args.quick, [int(x) for x in (args.sizes or default).split(",")], args.out))
