"""The learner on the real stack: outcomes with embeddings, heuristics and
anti-patterns from repeated runs, artifacts, cleanup and retention, the
dimension check, and a learner SIGKILLed mid-batch."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from alma_core import errors
from alma_core.consumers.worker import Services, run_worker
from alma_core.memory import ArtifactLink
from alma_core.sdk.client import AlmaClient
from alma_core.settings import RetentionPolicy, Settings
from alma_core.storage import retention, tenant_settings
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.postgres import connect
from alma_core.storage.retrieval import Retriever
from alma_core.types import RetrievalScope, WorkflowContext
from tests.integration.harness import (
    Publisher,
    Worker,
    WorkerProcess,
    completed,
    count,
    event,
    fetch,
    wait_for,
)

WF = "research"


CHECKPOINTS_30 = RetentionPolicy(checkpoints_days=30)  # the checkpoints step alone


def run_events(
    run: str, *, fail_at: str | None = None, message: str = "", tenant: str = "acme", **done: Any
) -> list[dict[str, Any]]:
    """A run of nodes fetch → parse → summarise; with ``fail_at``, it stops there."""
    docs = []
    for node in ("fetch", "parse", "summarise"):
        if node == fail_at:
            docs.append(
                event(
                    "node.failed",
                    run,
                    tenant=tenant,
                    workflow=WF,
                    node=node,
                    error={"type": "ValueError", "message": message},
                )
            )
            break
        docs.append(completed(run, tenant=tenant, workflow=WF, node=node, updates={node: True}))
    ok = fail_at is None
    payload: dict[str, Any] = {
        "outcome": "success" if ok else "failure",
        "duration_ms": 1500,
        "node_count": 3,
        "nodes_succeeded": len(docs) - (0 if ok else 1),
        "nodes_failed": 0 if ok else 1,
        "task": "summarise the research papers on graph databases",
        **done,
    }
    docs.append(event("workflow.completed", run, tenant=tenant, workflow=WF, node=None, **payload))
    return docs


async def publish(settings: Settings, docs: list[dict[str, Any]]) -> None:
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for doc in docs:
            await pub.send(doc)
        await pub.flush()


ARTIFACT = {
    "id": "report-1",
    "artifact_type": "report",
    "storage_path": "s3://b/report-1.pdf",
    "content_hash": "sha256:ab12",
    "size_bytes": 2048,
}


async def test_learns_outcomes_heuristics_and_anti_patterns(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    docs: list[dict[str, Any]] = []
    for i in range(3):
        docs += run_events(f"ok-{i}", artifacts=[ARTIFACT] if i == 0 else [])
    for i in range(2):  # the same failure, with different numbers in the message
        docs += run_events(
            f"bad-{i}",
            fail_at="parse",
            message=f"unexpected tag at line {40 + i}",
            artifacts=[{**ARTIFACT, "id": f"log-{i}"}],
        )
    async with Worker.start(settings, ("checkpointer", "learner"), embedder):
        await publish(settings, docs)

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 5

        await wait_for(learned, limit_s=60, what="five outcomes")
        await asyncio.sleep(0.3)
    outcomes = await fetch(
        dsn,
        "SELECT run_id, success, failing_node, strategy, learnings_extracted, "
        "vector_dims(embedding) AS dims, description FROM workflow_outcomes ORDER BY run_id",
    )
    assert all(o["dims"] == 384 for o in outcomes)
    bad = [o for o in outcomes if not o["success"]]
    assert [o["failing_node"] for o in bad] == ["parse", "parse"]
    assert "unexpected tag" in bad[0]["description"]
    memories = await fetch(
        dsn,
        "SELECT kind, node_id, run_id, occurrences, successes, confidence, content "
        "FROM memories ORDER BY kind, run_id",
    )
    kinds = [m["kind"] for m in memories]
    assert kinds.count("heuristic") == 1
    heuristic = next(m for m in memories if m["kind"] == "heuristic")
    assert (heuristic["occurrences"], heuristic["successes"]) == (3, 3)
    assert heuristic["confidence"] == pytest.approx(1.0)
    assert "fetch → parse → summarise" in heuristic["content"]
    anti = [m for m in memories if m["kind"] == "anti_pattern"]
    assert len(anti) == 1, "two failures with the same error, masked, are one anti-pattern"
    assert (anti[0]["node_id"], anti[0]["occurrences"]) == ("parse", 2)
    node_outcomes = [m for m in memories if m["kind"] == "outcome"]
    assert sorted(m["run_id"] for m in node_outcomes) == ["bad-0", "bad-1"]
    links = await fetch(dsn, "SELECT owner_type, artifact_id FROM artifact_links ORDER BY 1, 2")
    assert ("outcome", "report-1") in [tuple(r) for r in links]
    assert sum(1 for r in links if r["owner_type"] == "memory") >= 2

    async with connect(dsn) as pool:
        retriever = Retriever(pool, embedder)
        ctx = WorkflowContext(tenant_id="acme", workflow_id=WF)
        found = await retriever.retrieve("parsing the html fails", ctx, RetrievalScope.WORKFLOW)
        assert found.plan == "exact"
        assert [m.node_id for m in found.anti_patterns] == ["parse"]
        assert found.heuristics
        assert found.workflow_outcomes
        assert any(a.artifact_id.startswith("log-") for m in found.outcomes for a in m.artifacts)
        # read with the search itself: every field, each link on its own item only
        by_run = {o.run_id: o.artifacts for o in found.workflow_outcomes if o.artifacts}
        assert by_run == {
            "ok-0": (
                ArtifactLink("report-1", "report", "s3://b/report-1.pdf", "sha256:ab12", 2048, {}),
            ),
            "bad-0": (ArtifactLink("log-0", "report", "s3://b/report-1.pdf", "sha256:ab12", 2048),),
            "bad-1": (ArtifactLink("log-1", "report", "s3://b/report-1.pdf", "sha256:ab12", 2048),),
        }
        for m in found.outcomes:
            assert [a.artifact_id for a in m.artifacts] == [f"log-{m.run_id[-1]}"]
        prompt = found.to_prompt(max_tokens=400)
        assert "Mistakes to avoid" in prompt
        assert "parse" in prompt
        other = WorkflowContext(tenant_id="globex", workflow_id=WF)
        assert (await retriever.retrieve("parsing", other, RetrievalScope.WORKFLOW)).empty


async def test_cleanup_after_learning_and_retention_of_closed_runs_only(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    old = (datetime.now(UTC) - timedelta(days=40)).isoformat()
    docs = run_events("cleaned", cleanup_checkpoints=True)
    closed_long_ago = run_events("old-closed")
    closed_long_ago[-1]["emitted_at"] = old  # completed 40 days ago
    still_open = [completed("old-open", workflow=WF, node="fetch", updates={"x": 1})]
    still_open[0]["emitted_at"] = old
    recent = run_events("recent-closed")
    settings = settings.model_copy(update={"prune_every_seconds": 0})  # this test prunes
    async with Worker.start(settings, ("checkpointer", "learner"), embedder):
        await publish(settings, docs + closed_long_ago + still_open + recent)

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 3

        await wait_for(learned, limit_s=60, what="three outcomes")
    per_run = {
        r["run_id"]: r["n"]
        for r in await fetch(dsn, "SELECT run_id, count(*) AS n FROM checkpoints GROUP BY 1")
    }
    assert "cleaned" not in per_run, "cleanup_checkpoints removes the run's checkpoints"
    assert per_run == {"old-closed": 3, "old-open": 1, "recent-closed": 3}
    async with connect(dsn) as pool:
        pruned = await retention.prune(pool, CHECKPOINTS_30, batch_runs=1, max_batches=10)
        again = await retention.prune(pool, CHECKPOINTS_30)
    assert (pruned.runs, pruned.checkpoints, pruned.more) == (1, 3, False)
    assert again.runs == 0
    left = {r["run_id"] for r in await fetch(dsn, "SELECT DISTINCT run_id FROM checkpoints")}
    assert left == {"old-open", "recent-closed"}, "an open run is never pruned, however old"


async def test_a_tenant_whose_learner_is_off_is_passed_by_until_it_is_on_again(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    """`alma tenants set quiet --learner off`: the learner stores no outcome and no memory
    of quiet's runs (embeds nothing of them) but does the cleanup they ask for, while
    acme's runs are learned; turned back on, quiet's next run is learned, without a
    restart (within tenant_settings.REFRESH_S)."""
    dsn = settings.postgres_dsn
    assert dsn
    async with AlmaClient(settings) as client:
        await client.set_tenant_settings("quiet", learner=False)  # `alma tenants set`'s SDK
        async with Worker.start(settings, ("checkpointer", "learner"), embedder) as worker:
            await publish(
                settings,
                run_events("q-1", tenant="quiet", cleanup_checkpoints=True)
                + run_events("q-2", tenant="quiet", fail_at="parse", message="bad tag")
                + run_events("a-1"),
            )

            async def passed_by() -> bool:
                return worker.value("alma_outcomes_total", {"result": "not_learned"}) == 2

            await wait_for(passed_by, limit_s=60, what="quiet's two completions passed by")
            await wait_for(
                lambda: count(
                    dsn, "SELECT count(*) FROM workflow_outcomes WHERE tenant_id = 'acme'"
                ),
                limit_s=60,
                what="acme's outcome",
            )
            for table in ("workflow_outcomes", "memories"):
                quiet = f"SELECT count(*) FROM {table} WHERE tenant_id = 'quiet'"
                assert await count(dsn, quiet) == 0, table
            checkpoints = (
                "SELECT count(*) FROM checkpoints WHERE tenant_id = 'quiet' AND run_id = $1"
            )
            assert await count(dsn, checkpoints, "q-1") == 0  # the cleanup it asked for
            assert await count(dsn, checkpoints, "q-2") > 0  # no cleanup asked: kept
            assert worker.value("alma_outcomes_total", {"result": "stored"}) == 1

            assert (await client.tenant_settings("quiet")).learner is False
            await client.set_tenant_settings("quiet")  # back to the global: on
            await asyncio.sleep(tenant_settings.REFRESH_S)  # the time it takes, stated
            await publish(settings, run_events("q-3", tenant="quiet"))

            async def learned() -> bool:
                quiet = "SELECT count(*) FROM workflow_outcomes WHERE tenant_id = 'quiet'"
                return await count(dsn, quiet) == 1

            await wait_for(learned, limit_s=60, what="q-3 learned")
        assert (await client.tenant_settings("quiet")).learns
    rows = await fetch(dsn, "SELECT run_id FROM workflow_outcomes WHERE tenant_id = 'quiet'")
    assert [r["run_id"] for r in rows] == ["q-3"]
    assert worker.value("alma_outcomes_total", {"result": "not_learned"}) == 2


async def test_embedding_dimension_mismatch_is_a_clear_start_up_error(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    conn = await asyncpg.connect(dsn)
    try:
        # a database made for another model (its half copy goes with it: 0009)
        await conn.execute(
            "ALTER TABLE memories DROP COLUMN embedding_half, "
            "ALTER COLUMN embedding TYPE vector(16)"
        )
    finally:
        await conn.close()
    services = Services(settings.kafka_bootstrap or "", dsn, settings.redis_url or "")
    with pytest.raises(
        errors.ConfigError,
        match=r"384-dimensional.*memories.embedding is "
        r"vector\(16\)",
    ):
        await run_worker(settings, services, ["learn"], asyncio.Event(), embedder=embedder)


@pytest.mark.chaos
@pytest.mark.slow
async def test_learner_killed_mid_batch_learns_each_run_once(
    settings: Settings, embedder: AsyncEmbedder, tmp_path: Path
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    docs: list[dict[str, Any]] = []
    for i in range(24):
        fail = "parse" if i % 3 == 0 else None
        docs += run_events(
            f"r{i:02d}",
            fail_at=fail,
            message="timeout after 30 s",
            artifacts=[{**ARTIFACT, "id": f"a{i}"}],
        )
    learner = WorkerProcess(settings, tmp_path / "learner.log", consumers="learn").start()
    try:
        async with Worker.start(settings, ("checkpointer",)):
            await learner.wait_started(limit_s=120)
            await publish(settings, docs[: len(docs) // 2])
            await publish(settings, docs[len(docs) // 2 :])

            async def some() -> bool:
                return await count(dsn, "SELECT count(*) FROM workflow_outcomes") >= 4

            await wait_for(some, limit_s=60, what="the first outcomes")
            learner.kill()  # mid-stream: some batches applied, some not
            learner.start()
            await learner.wait_started(limit_s=120)

            async def all_in() -> bool:
                return await count(dsn, "SELECT count(*) FROM workflow_outcomes") >= 24

            await wait_for(all_in, limit_s=120, what="24 outcomes")
            await asyncio.sleep(0.5)
    finally:
        assert learner.terminate() == 0
    rows = await fetch(dsn, "SELECT run_id, count(*) AS n FROM workflow_outcomes GROUP BY 1")
    assert len(rows) == 24  # one per run (also what the table's unique keys allow)
    assert all(r["n"] == 1 for r in rows)
    # the learner's own part: it applied every hand-off once and skipped none; its stored
    # offsets end where the log ends (the fence dropped what the killed member had applied)
    group = f"{settings.group_prefix}-learner"
    applied_to = await count(
        dsn, "SELECT coalesce(sum(next_offset), 0) FROM consumer_offsets WHERE group_id = $1", group
    )
    assert applied_to == 24  # one hand-off per completion on the sequenced topic
    # memories counted from the stored outcomes, never incremented: no run counted twice
    derived = await fetch(
        dsn,
        """SELECT m.kind, m.occurrences,
                  (SELECT count(*) FROM workflow_outcomes o WHERE o.tenant_id = m.tenant_id
                     AND (m.kind <> 'heuristic' OR o.strategy = m.strategy)
                     AND (m.kind <> 'anti_pattern' OR
                          o.error_signature = m.metadata->>'error_signature')) AS outcomes
           FROM memories m WHERE m.kind IN ('heuristic', 'anti_pattern')""",
    )
    assert all(r["occurrences"] == r["outcomes"] for r in derived), derived
    memories = await fetch(dsn, "SELECT kind, occurrences, successes FROM memories")
    assert sorted(m["kind"] for m in memories if m["kind"] != "outcome") == [
        "anti_pattern",
        "heuristic",
    ]
    anti = next(m for m in memories if m["kind"] == "anti_pattern")
    heuristic = next(m for m in memories if m["kind"] == "heuristic")
    assert anti["occurrences"] == 8, "counted from the stored outcomes: never twice"
    assert (heuristic["occurrences"], heuristic["successes"]) == (16, 16)
    assert sum(1 for m in memories if m["kind"] == "outcome") == 8
    links = await count(dsn, "SELECT count(*) FROM artifact_links WHERE owner_type = 'outcome'")
    assert links == 24


@pytest.mark.slow
async def test_cli_retrieve_and_prune(settings: Settings, embedder: AsyncEmbedder) -> None:
    from tests.integration.test_cli import alma
    from tests.integration.test_cli_runs import env_of

    dsn = settings.postgres_dsn
    assert dsn
    docs = run_events("c-0") + run_events("c-1", fail_at="parse", message="bad tag at line 3")
    docs += run_events("c-2", fail_at="parse", message="bad tag at line 9")
    async with Worker.start(settings, ("checkpointer", "learner"), embedder) as worker:
        await publish(settings, docs)

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 3

        await wait_for(learned, limit_s=60, what="three outcomes")
        env = env_of(settings)
        # the task embedded by the learner's model, at its /embed (as beside `alma up`)
        served = env | {"ALMA_EMBED_URL": f"http://127.0.0.1:{worker.status.http_port}/embed"}
        found = await asyncio.to_thread(
            alma,
            "retrieve",
            "the html parser breaks",
            "--tenant",
            "acme",
            "--workflow",
            WF,
            "--scope",
            "workflow",
            "--json",
            env=served,
        )
    assert found.returncode == 0, found.stderr
    doc = json.loads(found.stdout)
    assert doc["scope"] == "workflow"
    assert doc["plan"] == "exact"
    kinds = {i.get("kind") for i in doc["items"]}
    assert {"anti_pattern", "outcome"} <= kinds
    assert "Mistakes to avoid" in doc["prompt"]
    human = alma("retrieve", "parser", "--tenant", "acme", "--workflow", WF, env=env)
    assert human.returncode == 0
    assert "workflow scope, exact search" in human.stdout
    # bad input: a scope whose context is missing, no tenant in multi-tenant mode
    no_node = alma("retrieve", "x", "--tenant", "acme", "--scope", "node", env=env)
    assert no_node.returncode == 2  # wrong usage
    assert "NODE scope needs run_id" in no_node.stderr
    no_tenant = alma("retrieve", "x", "--workflow", WF, env=env)
    assert no_tenant.returncode == 2
    assert "pass --tenant" in no_tenant.stderr
    assert "ALMA_TENANT" in no_tenant.stderr
    # retention: lifetimes from the settings, overridable per call, checked together
    refused = alma("db", "prune", "--runs-days", "10", env=env)
    assert refused.returncode == 2
    assert "ALMA_RUN_RETENTION_DAYS=10" in refused.stderr
    assert "ALMA_EVENT_RETENTION_DAYS=30" in refused.stderr
    too_young = alma("db", "prune", env=env)
    assert too_young.returncode == 0, too_young.stderr
    assert "pruned 0 checkpoints of 0 runs" in too_young.stdout
    async with connect(dsn) as pool:
        await pool.execute("UPDATE runs SET completed_at = now() - interval '40 days'")
    pruned = alma("db", "prune", env=env)
    assert pruned.returncode == 0, pruned.stderr
    assert "pruned 7 checkpoints of 3 runs" in pruned.stdout  # 3 + 2 + 2
    assert await count(dsn, "SELECT count(*) FROM checkpoints") == 0
    assert await count(dsn, "SELECT count(*) FROM run_events") == 0
    assert await count(dsn, "SELECT count(*) FROM runs") == 3, "run rows stay 90 days"


def _learner_batch(docs: list[dict[str, Any]], start: int) -> Any:
    """Completions as the learner's records at consecutive offsets, and each one
    drafted and embedded (vectors made up, one per text: the store writes what it is
    given)."""
    from alma_core import learning
    from alma_core.schemas.decoder import decode
    from alma_core.storage.batches import Incoming
    from alma_core.storage.memories import Prepared

    records, prepared = [], {}
    for i, doc in enumerate(docs):
        raw, key = json.dumps(doc).encode(), doc["run_id"].encode()
        record = Incoming("sequenced", 0, start + i, key, raw, decode(raw, key=key), (), start + i)
        p = doc["payload"]
        run = learning.FinishedRun(
            doc["tenant_id"], doc["workflow_id"], doc["run_id"], doc["event_id"],
            p["outcome"] == "success", p["duration_ms"], p["node_count"],
            p["nodes_succeeded"], p["nodes_failed"], task=p.get("task"),
        )  # fmt: skip
        d = learning.draft(run, [])
        vectors = {t: [(n + 1) / 1024] + [0.0] * 383 for n, t in enumerate(d.texts())}
        prepared[record.coords] = Prepared(d, vectors, [], cleanup=False)
        records.append(record)
    return {("sequenced", 0): records}, prepared


async def test_outcomes_of_one_batch_are_inserted_at_once_each_run_once(database: str) -> None:
    """The outcomes of a batch go in as one statement: a run completed twice in the
    batch (a new event id), a run stored by an earlier batch and a redelivered
    completion are each one outcome, counted as duplicates, with its own vector."""
    from alma_core.storage.memories import LearnConfig, PostgresLearnStore

    def done(run: str, event_id: str | None = None) -> dict[str, Any]:
        return event(
            "workflow.completed", run, workflow=WF, node=None, event_id=event_id,
            outcome="success", duration_ms=10, node_count=1, nodes_succeeded=1,
            nodes_failed=0, task=f"task of {run}",
        )  # fmt: skip

    a, b, c = done("a"), done("b"), done("c")
    async with connect(database) as pool:
        store = PostgresLearnStore(pool, LearnConfig("alma-learner", "learner", "dlq"))
        batch, prepared = _learner_batch([a, done("a"), b], 0)
        first = await store.transact("cluster", batch, prepared)
        assert first.effects is not None
        assert (first.effects.outcomes, first.effects.duplicates) == (2, 1)
        # the next batch: b again (a redelivery, another offset), then a new run c
        batch, prepared = _learner_batch([done("b", b["event_id"]), c], 3)
        second = await store.transact("cluster", batch, prepared)
        assert second.effects is not None
        assert (second.effects.outcomes, second.effects.duplicates) == (1, 1)
    rows = await fetch(
        database,
        "SELECT run_id, event_id, task, description, embedding::text AS v "
        "FROM workflow_outcomes ORDER BY run_id",
    )
    assert [(r["run_id"], r["event_id"], r["task"]) for r in rows] == [
        ("a", a["event_id"], "task of a"),
        ("b", b["event_id"], "task of b"),
        ("c", c["event_id"], "task of c"),
    ]
    assert all(r["v"].startswith(f"[{1 / 1024},") for r in rows), "each its description's vector"
