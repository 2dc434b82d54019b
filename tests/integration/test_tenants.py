"""A run belongs to its tenant (docs/guarantees.md §6): a run is (tenant_id, run_id) and an event
(tenant_id, event_id). Two tenants that name a run, its events and its join alike (an
orchestrator names runs per namespace) run it at the same time through checkpoints,
updates with reducers, a join and an outcome; neither sees nor blocks the other, and a
read with the wrong tenant finds nothing."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from alma_core.types import WorkflowContext
from tests.integration.harness import (
    Publisher,
    Worker,
    assert_cache_matches,
    completed,
    count,
    fetch,
    wait_for,
)

TENANTS = ("acme", "globex")
RUN = "invoice-42"


async def run_as(client: AlmaClient, tenant: str) -> dict[str, object]:
    """One tenant's run, with the ids every tenant uses: event ids e0.., join j1, done."""
    run = WorkflowContext(tenant_id=tenant, workflow_id="billing", run_id=RUN)
    await client.register_reducers(run, {"lines": "append", "total": "sum"})
    for i in range(3):
        at = replace(run, node_id=f"step{i}")
        await client.node_completed(
            at, updates={"lines": [f"{tenant}-{i}"], "total": i}, event_id=f"e{i}"
        )
    for branch in ("a", "b"):
        at = replace(run, node_id=f"check-{branch}", branch_id=branch)
        await client.node_completed(
            at, updates={"lines": [f"{tenant}-{branch}"]}, event_id=f"e-{branch}"
        )
    reply = await client.merge(run, branch_ids=["a", "b"], join_id="j1", timeout=60)
    await client.workflow_completed(
        run,
        success=True,
        duration_ms=10,
        node_count=5,
        nodes_succeeded=5,
        nodes_failed=0,
        task=f"bill {tenant}",
        event_id="done",
    )
    return reply.merged_state or {}


async def test_two_tenants_run_one_run_id_without_touching_each_other(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    dsn = settings.postgres_dsn or ""
    async with (
        Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder),
        AlmaClient(settings) as client,
    ):
        merged = await asyncio.gather(*(run_as(client, t) for t in TENANTS))

        async def both_learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 2

        await wait_for(both_learned, limit_s=60, what="both outcomes")
        for tenant, state in zip(TENANTS, merged, strict=True):
            assert state == {
                "lines": [f"{tenant}-{i}" for i in range(3)] + [f"{tenant}-a", f"{tenant}-b"],
                "total": 3,
            }
            point = await client.resume(WorkflowContext(tenant, "billing", None, RUN))
            assert point.latest is not None
            assert (point.latest.seq, point.state) == (6, state)  # 3 steps, 2 branches, merge
        nobody = await client.resume(WorkflowContext("nobody", "billing", None, RUN))
        assert nobody.latest is None
    rows = await fetch(
        dsn,
        """SELECT tenant_id, count(*) AS n, max(seq) AS last FROM checkpoints
           WHERE run_id = $1 GROUP BY 1 ORDER BY 1""",
        RUN,
    )
    assert [tuple(r) for r in rows] == [("acme", 6, 6), ("globex", 6, 6)]
    events = await fetch(dsn, "SELECT tenant_id, count(*) AS n FROM run_events GROUP BY 1")
    assert {r["tenant_id"]: r["n"] for r in events} == {"acme": 7, "globex": 7}
    outcomes = await fetch(dsn, "SELECT tenant_id, task FROM workflow_outcomes ORDER BY 1")
    assert [tuple(r) for r in outcomes] == [("acme", "bill acme"), ("globex", "bill globex")]
    assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0
    async with connect(dsn) as pool:
        operator = CheckpointReader(pool, None, tenant_id=None, require_tenant=False)
        with pytest.raises(errors.ContextError, match="acme, globex"):
            await operator.latest(RUN)  # whose? it says so instead of mixing them
        assert await CheckpointReader(pool, None, tenant_id="globex").latest("nope") is None


async def test_one_batch_caches_each_tenants_run_of_one_id_apart(settings: Settings) -> None:
    """Both tenants' events for one run id in one polled batch (published before the
    worker starts): each tenant's cached latest is its own run's PostgreSQL head."""
    dsn = settings.postgres_dsn or ""
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for i in range(5):
            for tenant, steps in (("acme", 5), ("globex", 3)):
                if i < steps:
                    await pub.send(completed(RUN, tenant=tenant, node=f"n{i}", state={"i": i}))
        await pub.flush()
    async with Worker.start(settings):

        async def all_in() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 8

        await wait_for(all_in, what="both tenants' checkpoints")
        for tenant in TENANTS:
            assert await assert_cache_matches(settings, [RUN], require_all=True, tenant=tenant) == 1
