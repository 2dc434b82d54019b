"""The SDK's publishing side on the real stack: each lifecycle call becomes the
right event, keyed by run_id, and the context is checked before anything is sent."""

from __future__ import annotations

from dataclasses import replace

import pytest

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from tests.integration.harness import Worker, count, fetch, wait_for

RUN = WorkflowContext(tenant_id="acme", workflow_id="wf", run_id="sdk-run")


@pytest.mark.smoke
async def test_lifecycle_calls_become_checkpoints(settings: Settings, worker: Worker) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    async with AlmaClient(settings) as client:
        node = replace(RUN, node_id="fetch")
        await client.node_started(node, attempt=1, input={"url": "https://example.org"})
        await client.node_completed(node, updates={"pages": 3})
        await client.node_failed(
            replace(RUN, node_id="parse"),
            error_type="ValueError",
            message="bad html",
            updates={"pages": 4},
        )
        retry = replace(RUN, node_id="parse")
        await client.node_completed(retry, updates={"pages": 5}, expected_seq=2)
        await client.workflow_completed(
            RUN,
            success=True,
            duration_ms=1200,
            node_count=2,
            nodes_succeeded=2,
            nodes_failed=0,
            task="scrape",
        )

    async def all_recorded() -> bool:
        return await count(dsn, "SELECT count(*) FROM run_events") == 5

    await wait_for(all_recorded, what="the five events")
    rows = await fetch(dsn, "SELECT seq, kind, node_id, state FROM checkpoints ORDER BY seq")
    assert [(r["seq"], r["kind"], r["node_id"], r["state"]) for r in rows] == [
        (1, "node", "fetch", {"pages": 3}),
        (2, "failure", "parse", {"pages": 4}),
        (3, "node", "parse", {"pages": 5}),
    ]
    run = await fetch(dsn, "SELECT status, completed_at FROM runs WHERE run_id = 'sdk-run'")
    assert run[0]["status"] == "succeeded"


async def test_context_is_checked_before_sending(settings: Settings) -> None:
    async with AlmaClient(settings) as client:
        with pytest.raises(errors.ContextError, match="needs node_id"):
            await client.node_completed(RUN, updates={"a": 1})
        with pytest.raises(errors.ContextError, match="tenant_id is required"):
            await client.node_completed(
                WorkflowContext(workflow_id="wf", run_id="r", node_id="n"), updates={"a": 1}
            )
        with pytest.raises(errors.ContextError, match="run_id requires workflow_id"):
            await client.node_started(WorkflowContext(tenant_id="t", run_id="r", node_id="n"))
        with pytest.raises(errors.ContextError, match="exactly one of 'state' or 'updates'"):
            await client.node_completed(replace(RUN, node_id="n"))


async def test_an_orchestrator_that_crashed_resumes_from_the_latest_checkpoint(
    settings: Settings, worker: Worker
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    async with AlmaClient(settings) as before_crash:
        await before_crash.node_completed(replace(RUN, node_id="a"), updates={"done": ["a"]})
        await before_crash.node_completed(replace(RUN, node_id="b"), updates={"done": ["a", "b"]})
        await before_crash.node_completed(
            replace(RUN, node_id="x", branch_id="side"), updates={"side": True}
        )

    async def three() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

    await wait_for(three, what="three checkpoints")
    async with AlmaClient(settings) as after_restart:  # a new process: nothing in memory
        point = await after_restart.resume(RUN)
        assert point.latest is not None
        assert (point.latest.seq, point.latest.branch_id) == (3, "side")
        assert point.state == {"done": ["a", "b"]}
        assert {b: cp.node_id for b, cp in point.branch_heads.items()} == {None: "b", "side": "x"}
        fresh = await after_restart.resume(replace(RUN, run_id="never-ran"))
        assert (fresh.latest, fresh.state) == (None, {})
        other = await after_restart.resume(replace(RUN, tenant_id="globex"))
        assert other.latest is None


async def test_an_event_id_reused_by_another_run_is_refused_clearly(
    settings: Settings, worker: Worker
) -> None:
    """An orchestrator that derives event ids badly publishes one id for two runs: the
    second is dead-lettered as event_id_reused, and applied() says so instead of
    confirming it with the first run's checkpoint."""
    async with AlmaClient(settings) as client:
        first = replace(RUN, run_id="owner", node_id="n")
        second = replace(RUN, run_id="borrower", node_id="n")
        await client.node_completed(first, state={"a": 1}, event_id="same-id")
        assert (await client.applied(first, "same-id")).seq == 1
        await client.node_completed(second, state={"b": 2}, event_id="same-id")
        with pytest.raises(errors.EventIdReused, match="owner"):
            await client.applied(second, "same-id", timeout=20)
        # the owner's effect is untouched, and still confirmed for the owner
        assert (await client.applied(first, "same-id")).seq == 1
    dsn = settings.postgres_dsn or ""
    assert await count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id = 'borrower'") == 0


async def test_a_completed_run_refuses_the_same_script_run_again(
    settings: Settings, worker: Worker
) -> None:
    """A script run twice with one run id: the second run's node events are refused as
    run_completed (dead letters, and applied() raises) instead of moving the finished
    run on (seq 6-9, a `sum` of 84); its join is answered with the refusal at once, not
    after the merge timeout; the first outcome stands."""
    dsn = settings.postgres_dsn or ""
    ctx = replace(RUN, run_id="twice")
    async with AlmaClient(settings) as client:
        await client.register_reducers(ctx, {"total": "sum"})

        async def script() -> list[str]:
            sent = [
                await client.node_completed(replace(ctx, node_id=f"n{i}"), updates={"total": 21})
                for i in range(2)
            ]
            sent.append(
                await client.workflow_completed(
                    ctx,
                    success=True,
                    duration_ms=5,
                    node_count=2,
                    nodes_succeeded=2,
                    nodes_failed=0,
                )
            )
            return sent

        first = await script()
        assert (await client.applied(ctx, first[1])).seq == 2
        await client.applied(ctx, first[2])
        again = await script()
        for event_id in again[:2]:
            with pytest.raises(errors.RunCompleted, match="give new work a new run id"):
                await client.applied(ctx, event_id, timeout=20)
        with pytest.raises(errors.MergeFailed, match="run_completed"):
            await client.merge(replace(ctx, node_id="join"), states=[{"total": 1}], timeout=20)
        point = await client.resume(ctx)
        assert (point.status, point.latest.seq if point.latest else None) == ("succeeded", 2)
        assert point.state == {"total": 42}
    refused = await count(
        dsn, "SELECT count(*) FROM dead_letters WHERE reason = 'run_completed' AND run_id = 'twice'"
    )
    assert refused == 3  # two node events and the join
