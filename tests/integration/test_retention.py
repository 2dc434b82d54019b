"""Retention on the real stack: every table that grows with traffic is pruned in
bounded batches, an open run never is, and an event replayed after a run's inbox was
pruned has no effect (it is dead-lettered as ``run_pruned``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from alma_core.cli.topics import until_led
from alma_core.sdk.client import AlmaClient
from alma_core.settings import RetentionPolicy, Settings
from alma_core.storage import retention, tenant_settings
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.postgres import connect
from alma_core.types import WorkflowContext
from tests.integration.harness import (
    Publisher,
    Worker,
    completed,
    count,
    event,
    fetch,
    wait_for,
)

WF = "wf"
# a closed run past its checkpoint and event lifetimes, before its row's
PRUNED_BUT_KEPT = {"checkpoints": 0, "run_heads": 0, "run_events": 0, "joins": 0, "runs": 1}


def finish(run: str, outcome: str = "success", **payload: Any) -> dict[str, Any]:
    ok = outcome == "success"
    return event(
        "workflow.completed",
        run,
        node=None,
        outcome=outcome,
        duration_ms=10,
        node_count=3,
        nodes_succeeded=3 if ok else 2,
        nodes_failed=0 if ok else 1,
        task="file the quarterly invoices",
        **payload,
    )


async def rows_of(dsn: str, run: str) -> dict[str, int]:
    tables = ("checkpoints", "run_heads", "run_events", "joins", "runs")
    return {
        t: await count(
            dsn, f"SELECT count(*) FROM {t} WHERE tenant_id = 'acme' AND run_id = $1", run
        )
        for t in tables
    }


async def send_all(settings: Settings, docs: list[dict[str, Any]]) -> None:
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for doc in docs:
            await pub.send(doc)
        await pub.flush()


async def test_closed_runs_are_pruned_in_steps_and_a_replay_has_no_effect(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    dsn = settings.postgres_dsn or ""
    settings = settings.model_copy(update={"prune_every_seconds": 0})  # this test prunes
    old = [
        completed("old", node="start", updates={"log": ["start"]}),
        completed("old", node="a", branch="b0", updates={"log": ["a"]}),
        completed("old", node="b", branch="b1", updates={"log": ["b"]}),
    ]
    old_end = [
        event("node.failed", "old", node="file", error={"type": "Http503", "message": "fx down"}),
        finish("old", "failure", error_message="fx down"),
    ]
    others = [
        completed("old2", node="start", updates={"n": 1}),
        finish("old2"),
        completed("recent", node="start", updates={"n": 1}),
        finish("recent"),
        completed("open", node="start", updates={"n": 1}),  # never completed
    ]
    async with (
        Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder),
        AlmaClient(settings) as client,
    ):
        await send_all(settings, old)

        async def branches() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

        await wait_for(branches, what="the branch checkpoints")
        ctx = WorkflowContext(tenant_id="acme", workflow_id=WF, run_id="old", node_id="join")
        reply = await client.merge(ctx, branch_ids=["b0", "b1"], reducers={"log": "append"})
        assert reply.checkpoint_seq == 4
        await send_all(settings, old_end + others)
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            await pub.send(b"{not json", key=b"hostile")
            await pub.flush()

        async def settled() -> bool:
            outcomes = await count(dsn, "SELECT count(*) FROM workflow_outcomes")
            letters = await fetch(dsn, "SELECT consumer, reason, detail FROM dead_letters")
            return outcomes == 3 and len(letters) == 1

        await wait_for(settled, limit_s=60, what="three outcomes and one dead letter")
    before = await rows_of(dsn, "old")
    # 3 node checkpoints, the merge, the failure; the join consumed its branches' heads
    assert before == {"checkpoints": 5, "run_heads": 1, "run_events": 6, "joins": 1, "runs": 1}
    outcome_memories = await count(dsn, "SELECT count(*) FROM memories WHERE kind = 'outcome'")
    assert outcome_memories == 1  # the failed node of "old"
    last_seq = await count(dsn, "SELECT last_seq FROM runs WHERE run_id = 'old'")

    policy = settings.retention  # the defaults: 30, 30, 90 days; dead letters 30, memories 180
    async with connect(dsn) as pool:
        await pool.execute(
            """UPDATE runs SET completed_at = now() - interval '45 days'
               WHERE run_id IN ('old', 'old2');
               UPDATE runs SET updated_at = now() - interval '400 days',
                               created_at = now() - interval '400 days' WHERE run_id = 'open'"""
        )
        first = await retention.prune(pool, policy, batch_runs=1, max_batches=1)
        assert first.more, "one run per batch, one batch per step: work is left"
        rest = await retention.prune(pool, policy, batch_runs=1, max_batches=5)
        assert not rest.more
    assert sorted(first.pruned + rest.pruned) == [("acme", "old"), ("acme", "old2")]
    assert first.checkpoints + rest.checkpoints == 5 + 1
    assert first.joins + rest.joins == 1
    assert first.runs_deleted + rest.runs_deleted == 0, "run rows stay 90 days"
    assert await rows_of(dsn, "old") == PRUNED_BUT_KEPT
    for kept in ("recent", "open"):
        assert (await rows_of(dsn, kept))["checkpoints"] == 1, f"{kept} is not old or not closed"

    # Every event of "old" again (same ids: a replay after the inbox rows went), a new
    # one, and a join: none has an effect; each is a dead letter naming the reason.
    late_join = event("branch.join", "old", node="join", join_id="j-late", branch_ids=["b0"])
    replay = old + old_end + [completed("old", node="late", updates={"log": ["late"]}), late_join]
    async with Worker.start(settings, ("checkpointer", "joiner")):
        await send_all(settings, replay)

        async def refused() -> bool:
            sql = "SELECT count(*) FROM dead_letters WHERE reason = 'run_pruned'"
            return await count(dsn, sql) == len(replay)

        await wait_for(refused, what="the replay refused")
    assert await rows_of(dsn, "old") == PRUNED_BUT_KEPT
    assert await count(dsn, "SELECT last_seq FROM runs WHERE run_id = 'old'") == last_seq
    assert await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 3

    # Past the run lifetime the row goes; old dead letters and node outcomes age out.
    async with connect(dsn) as pool:
        await pool.execute(
            """UPDATE runs SET completed_at = now() - interval '100 days'
               WHERE run_id IN ('old', 'old2');
               UPDATE dead_letters SET created_at = now() - interval '40 days';
               UPDATE memories SET created_at = now() - interval '200 days'"""
        )
        last = await retention.prune(pool, policy)
        again = await retention.prune(pool, policy)
    assert (last.runs_deleted, last.dead_letters, last.outcome_memories) == (2, 1 + len(replay), 1)
    assert not any(again.rows().values()), again
    remaining = {r["run_id"] for r in await fetch(dsn, "SELECT run_id FROM runs")}
    assert remaining == {"recent", "open"}
    # what learning is made of stays: outcomes, and memories other than node outcomes
    assert await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 3
    assert await count(dsn, "SELECT count(*) FROM memories WHERE kind = 'outcome'") == 0


async def test_a_tenants_own_checkpoint_retention_holds_beside_the_global_one(
    settings: Settings,
) -> None:
    """`alma tenants set T --checkpoint-retention-days D`: acme keeps its closed runs'
    checkpoints 5 days while the global lifetime is 30, globex forever (0) whatever the
    global one, and initech's own 5 days hold where no global lifetime is set at all."""
    dsn = settings.postgres_dsn or ""
    tenants = ("acme", "globex", "initech")
    docs: list[dict[str, Any]] = []
    for tenant in tenants:
        docs += [
            completed("r", tenant=tenant, node="start", updates={"n": 1}),
            finish("r", tenant=tenant),
        ]
    async with Worker.start(settings, ("checkpointer",)):
        await send_all(settings, docs)

        async def closed() -> bool:
            done = "SELECT count(*) FROM runs WHERE completed_at IS NOT NULL"
            return await count(dsn, done) == len(tenants)

        await wait_for(closed, what="three closed runs")
    kept = "SELECT tenant_id FROM checkpoints ORDER BY tenant_id"
    async with connect(dsn) as pool:
        await pool.execute("UPDATE runs SET completed_at = now() - interval '10 days'")
        await tenant_settings.store(
            pool, "acme", rate_per_s=None, burst=None, checkpoint_retention_days=5
        )
        await tenant_settings.store(
            pool, "globex", rate_per_s=None, burst=None, checkpoint_retention_days=0
        )
        held = await tenant_settings.usage(pool, "acme")  # what `alma tenants show` says
        assert (held.runs, held.open_runs, held.dead_letters, held.memories) == (1, 0, 0, 0)
        assert held.checkpoints > 0
        assert held.state_bytes > 0
        assert held.events == 2
        first = await retention.prune(pool, RetentionPolicy(checkpoints_days=30))
        assert (first.runs, first.pruned) == (1, [("acme", "r")])
        after = await tenant_settings.usage(pool, "acme")
        assert (after.runs, after.checkpoints, after.state_bytes, after.events) == (1, 0, 0, 2)
        assert await tenant_settings.usage(pool, "globex") == held  # another tenant's kept
        assert [r["tenant_id"] for r in await fetch(dsn, kept)] == ["globex", "initech"]
        # no global lifetime (0: forever): the tenants' own still hold
        await tenant_settings.store(
            pool, "initech", rate_per_s=None, burst=None, checkpoint_retention_days=5
        )
        second = await retention.prune(pool, RetentionPolicy())
        assert second.pruned == [("initech", "r")]
        third = await retention.prune(pool, RetentionPolicy(checkpoints_days=1))
        assert third.runs == 0  # globex: forever, whatever the global lifetime
        # the kept bytes each storage quota is held to: what was pruned is taken away
        standings = {s.tenant_id: s.used for s in await tenant_settings.storage(pool, 0)}
        assert standings["acme"] == standings["initech"] == 0
        assert standings["globex"] > 0
        sizes = "SELECT sum(size_bytes) FROM checkpoints WHERE tenant_id = 'globex'"
        assert standings["globex"] == await count(dsn, sizes)
    assert [r["tenant_id"] for r in await fetch(dsn, kept)] == ["globex"]


async def test_pruning_skips_a_run_the_checkpointer_holds(settings: Settings) -> None:
    """A pruner never waits for a run another transaction holds (the checkpointer's batch
    locks its runs): it takes the others and the held one on a later round."""
    dsn = settings.postgres_dsn or ""
    async with Worker.start(settings.model_copy(update={"prune_every_seconds": 0})):
        await send_all(settings, [completed(r, updates={"n": 1}) for r in ("held", "free")])
        await send_all(settings, [finish("held"), finish("free")])

        async def closed() -> bool:
            return await count(dsn, "SELECT count(*) FROM runs WHERE completed_at IS NOT NULL") == 2

        await wait_for(closed, what="two closed runs")
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("UPDATE runs SET completed_at = now() - interval '45 days'")
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM runs WHERE run_id = 'held' FOR UPDATE")
            async with connect(dsn) as pool:
                # bounded: a pruner that waited for the lock would never return here
                pruned = await asyncio.wait_for(retention.prune(pool, settings.retention), 30)
        assert pruned.pruned == [("acme", "free")]
        async with connect(dsn) as pool:
            later = await retention.prune(pool, settings.retention)
        assert later.pruned == [("acme", "held")]
    finally:
        await holder.close()


async def test_a_worker_warns_when_the_topic_outlives_run_rows(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a run row refuses the replay of its pruned events: a lifecycle topic that
    keeps records longer than run rows live is named at start, with what to change."""
    bootstrap = settings.kafka_bootstrap or ""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    f"{settings.lifecycle_topic}-{name}", 2, 1, topic_configs={"retention.ms": ms}
                )
                for name, ms in (("forever", "-1"), ("week", str(7 * 86_400_000)))
            ]
        )
        # led before a worker reads their configuration (Kafka elects after answering)
        names = [f"{settings.lifecycle_topic}-{n}" for n in ("forever", "week")]
        await until_led(admin, bootstrap, names)
    finally:
        await admin.close()
    warned = {}
    for name in ("forever", "week"):
        topic = f"{settings.lifecycle_topic}-{name}"
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            async with Worker.start(settings.model_copy(update={"lifecycle_topic": topic})):
                pass
        warned[name] = [r.getMessage() for r in caplog.records if "retention.ms" in r.getMessage()]
    assert warned["week"] == []  # 7 days < the 90 days run rows live
    (message,) = warned["forever"]
    assert "keeps records forever, longer than ALMA_RUN_RETENTION_DAYS=90" in message
    assert "set the topic's retention.ms below 7776000000" in message


async def test_a_langgraph_thread_is_left_to_langgraph(settings: Settings) -> None:
    """A thread goes on after ``acomplete`` (a chat's next turn): retention leaves it, its
    own ``adelete_thread``/``aprune`` remove it, as with LangGraph's savers."""
    dsn = settings.postgres_dsn or ""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """INSERT INTO runs (tenant_id, run_id, workflow_id, status, completed_at)
                 VALUES ('acme', 'chat', 'agent', 'succeeded', now() - interval '100 days'),
                        ('acme', 'batch', 'agent', 'succeeded', now() - interval '100 days');
               INSERT INTO graph_checkpoints (tenant_id, thread_id, checkpoint_id, checkpoint)
                 VALUES ('acme', 'chat', 'c1', '{}')"""
        )
    finally:
        await conn.close()
    async with connect(dsn) as pool:
        pruned = await retention.prune(pool, settings.retention)
    assert pruned.pruned == [("acme", "batch")]
    assert pruned.runs_deleted == 1
    assert await count(dsn, "SELECT count(*) FROM graph_checkpoints") == 1
    assert await count(dsn, "SELECT count(*) FROM runs WHERE checkpoints_pruned_at IS NULL") == 1


async def test_with_tenant_topics_each_tenants_topic_is_checked(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """With ALMA_TENANT_TOPICS the worker checks every tenant's lifecycle topic it finds
    at start: the one that keeps records forever is named, the other is not."""
    bootstrap = settings.kafka_bootstrap or ""
    base = f"{settings.lifecycle_topic}-tenanted"
    tenanted = settings.model_copy(update={"lifecycle_topic": base, "tenant_topics": True})
    names = {t: tenanted.topic_names.lifecycle_for(t) for t in ("keeper", "weekly")}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(names["keeper"], 2, 1, topic_configs={"retention.ms": "-1"}),
                NewTopic(names["weekly"], 2, 1, topic_configs={"retention.ms": "604800000"}),
            ]
        )
        await until_led(admin, bootstrap, list(names.values()))
    finally:
        await admin.close()
    with caplog.at_level(logging.WARNING):
        async with Worker.start(tenanted):
            pass
    warned = [r.getMessage() for r in caplog.records if "retention.ms" in r.getMessage()]
    assert len(warned) == 1
    assert f"the topic {names['keeper']} keeps records forever" in warned[0]
