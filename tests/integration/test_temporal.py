"""ALMA Stream driven by a real Temporal server (``temporal server start-dev``): workflows
and activities written as a Temporal team writes them, ALMA's plugin on the worker,
the real broker, PostgreSQL and Redis behind it.

What must hold: activities become checkpoints in order; parallel branches join with
reducers into one merged checkpoint the workflow receives; Temporal's retries leave a
failure checkpoint per failed attempt; a worker killed after ALMA made a node durable
but before Temporal recorded it leaves one effect; a replay publishes nothing; the run's
outcome is learned and retrievable from the next run's activity; and what ALMA
refuses fails the workflow with a clear error, never a hung activity.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import subprocess
import sys
import uuid
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowHistory
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from alma_core import errors
from alma_core.integrations.temporal import mapping
from alma_core.integrations.temporal.worker import AlmaPlugin
from alma_core.settings import Settings
from alma_core.storage.embeddings import AsyncEmbedder
from tests.integration import temporal_app as app
from tests.integration.harness import Worker as AlmaWorker
from tests.integration.harness import (
    count,
    fetch,
    register_reducers,
    run_script,
    wait_for,
    worker_env,
)

ROOT = Path(__file__).parents[2]
HISTORIES = Path(__file__).parent / "histories"


@contextlib.asynccontextmanager
async def temporal_worker(
    env: WorkflowEnvironment, settings: Settings, **plugin: Any
) -> AsyncIterator[str]:
    """A Temporal worker with ALMA's plugin, in this process, on its own task queue.
    No workflow cache: every workflow task replays the history, so the workflow side
    runs again and again and must publish nothing twice."""
    queue = f"q-{uuid.uuid4().hex[:10]}"
    async with Worker(
        env.client,
        task_queue=queue,
        workflows=app.WORKFLOWS,
        activities=app.ACTIVITIES,
        plugins=[AlmaPlugin(settings, tenant_id="acme", **plugin)],
        max_cached_workflows=0,
    ):
        yield queue


async def run_to_end(client: Client, workflow: Any, arg: str, queue: str) -> tuple[Any, str]:
    """Run a workflow; its result and its ALMA run id."""
    handle: WorkflowHandle[Any, Any] = await client.start_workflow(
        workflow, arg, id=f"wf-{uuid.uuid4().hex[:10]}", task_queue=queue
    )
    try:
        result = await handle.result()
    finally:
        run = mapping.run_id(handle.id, handle.result_run_id or "")
    return result, run


async def checkpoints(dsn: str, run: str) -> list[Any]:
    return await fetch(
        dsn,
        """SELECT seq, kind, node_id, branch_id, state, metadata, event_id FROM checkpoints
           WHERE run_id = $1 ORDER BY seq""",
        run,
    )


async def events(dsn: str, run: str) -> list[Any]:
    return await fetch(
        dsn,
        """SELECT type, node_id, payload, event_id FROM run_events WHERE run_id = $1
           ORDER BY ordinal""",
        run,
    )


async def run_status(dsn: str, run: str) -> str:
    rows = await fetch(dsn, "SELECT status FROM runs WHERE run_id = $1", run)
    return str(rows[0]["status"]) if rows else ""


async def finished(dsn: str, run: str, status: str) -> None:
    """Wait until the run's workflow.completed is applied with this status."""

    async def done() -> bool:
        return await run_status(dsn, run) == status

    await wait_for(done, what=f"the run's workflow.completed ({status})")


async def test_sequential_activities_become_checkpoints_in_order(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    dsn = settings.postgres_dsn or ""
    async with AlmaWorker.start(settings), temporal_worker(temporal, settings) as queue:
        result, run = await run_to_end(temporal.client, app.Research.run, "heat pumps", queue)

        await finished(dsn, run, "succeeded")
    rows = await checkpoints(dsn, run)
    assert [r["seq"] for r in rows] == [1, 2, 3]
    assert [r["node_id"] for r in rows] == ["plan", "fetch", "write"]
    assert rows[0]["state"] == {"topic": "heat pumps", "steps": ["fetch", "write"]}
    assert rows[-1]["state"] == result  # the run's state is what the workflow built
    assert all(r["branch_id"] is None for r in rows)
    seen = await events(dsn, run)
    assert [(e["type"], e["node_id"]) for e in seen] == [
        ("node.started", "plan"),
        ("node.completed", "plan"),
        ("node.started", "fetch"),
        ("node.completed", "fetch"),
        ("node.started", "write"),
        ("node.completed", "write"),
        ("workflow.completed", None),
    ]
    assert [e["payload"].get("attempt") for e in seen if e["type"] == "node.started"] == [1] * 3
    assert all(e["event_id"].startswith("t-") for e in seen)  # derived from Temporal's ids
    done = seen[-1]["payload"]
    assert (done["outcome"], done["node_count"], done["nodes_succeeded"]) == ("success", 3, 3)
    assert done["task"] == "write a research report on heat pumps"
    rows = await fetch(dsn, "SELECT tenant_id, workflow_id FROM runs WHERE run_id = $1", run)
    assert dict(rows[0]) == {"tenant_id": "acme", "workflow_id": "Research"}


async def test_the_outcome_counts_every_activity_execution(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    """An activity called three times is three nodes; two branches of one activity where
    one fails for good and the workflow tolerates it: five nodes, four succeeded, one
    failed, and the run did not succeed (no failure hidden behind a sibling's name)."""
    dsn = settings.postgres_dsn or ""
    async with AlmaWorker.start(settings), temporal_worker(temporal, settings) as queue:
        _, run = await run_to_end(temporal.client, app.Tolerant.run, "counts", queue)

        await finished(dsn, run, "failed")
    done = (await events(dsn, run))[-1]["payload"]
    counts = (done["node_count"], done["nodes_succeeded"], done["nodes_failed"])
    assert (done["outcome"], counts) == ("failure", (5, 4, 1))


async def test_a_parallel_fan_out_joins_with_reducers(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    dsn = settings.postgres_dsn or ""
    async with (
        AlmaWorker.start(settings, ("checkpointer", "joiner")),
        temporal_worker(temporal, settings) as queue,
    ):
        merged, run = await run_to_end(temporal.client, app.Review.run, "contract", queue)
    # the branches in the order the join names them, folded onto the main line
    assert merged == {
        "topic": "contract",
        "steps": ["fetch", "write"],
        "notes": ["legal ok", "finance ok", "security ok"],
        "risk": 7,
        "hours": 6,
    }
    rows = await checkpoints(dsn, run)
    assert [r["seq"] for r in rows] == [1, 2, 3, 4, 5]
    assert sorted(r["branch_id"] for r in rows[1:4]) == ["finance", "legal", "security"]
    assert all(r["node_id"] == "review" for r in rows[1:4])
    assert (rows[4]["kind"], rows[4]["state"]) == ("merge", merged)
    assert sorted(rows[4]["metadata"].items()) == [("join_id", "join-1")]
    # the join consumed its branches: the main line is the run's only head now
    heads = await fetch(dsn, "SELECT branch_key, seq FROM run_heads WHERE run_id = $1", run)
    assert {r["branch_key"]: r["seq"] for r in heads} == {"": 5}


async def test_updates_fold_with_the_reducers_the_plugin_registers(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    dsn = settings.postgres_dsn or ""
    reducers = {"Notes": {"notes": "append", "count": "sum"}}
    async with (
        AlmaWorker.start(settings),
        temporal_worker(temporal, settings, reducers=reducers) as queue,
    ):
        _, run = await run_to_end(temporal.client, app.Notes.run, "x", queue)
    rows = await checkpoints(dsn, run)
    assert rows[-1]["state"] == {"notes": ["first", "second"], "count": 2}
    # result="ignore": bytes recorded as the node's completion, the state untouched
    seen = await events(dsn, run)
    assert ("node.completed", "blob") in [(e["type"], e["node_id"]) for e in seen]
    assert len(rows) == 2


async def test_temporal_retries_leave_one_failure_checkpoint_per_attempt(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    dsn = settings.postgres_dsn or ""
    async with AlmaWorker.start(settings), temporal_worker(temporal, settings) as queue:
        result, run = await run_to_end(temporal.client, app.Flaky.run, "x", queue)
    assert result == {"fetched_on_attempt": 3}
    rows = await checkpoints(dsn, run)
    assert [(r["seq"], r["kind"]) for r in rows] == [(1, "failure"), (2, "failure"), (3, "node")]
    assert [r["metadata"].get("attempt") for r in rows[:2]] == [1, 2]
    assert rows[0]["metadata"]["error"]["message"] == "upstream 503 on attempt 1"
    assert rows[2]["state"] == result
    seen = await events(dsn, run)
    starts = [e["payload"]["attempt"] for e in seen if e["type"] == "node.started"]
    assert starts == [1, 2, 3]
    assert [e["type"] for e in seen].count("node.completed") == 1


@pytest.mark.slow
async def test_a_worker_killed_after_the_checkpoint_leaves_one_effect(
    temporal: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    """The worker process dies after ALMA made ``plan`` durable and before Temporal
    heard of it. Temporal times the attempt out and runs ``plan`` again on the
    restarted worker: ALMA has one checkpoint for it, two starts, gapless seqs."""
    dsn = settings.postgres_dsn or ""
    queue = f"q-{uuid.uuid4().hex[:10]}"
    marker = tmp_path / "die-once"
    marker.touch()
    env = {**worker_env(settings), "PYTHONPATH": str(ROOT)}
    address = temporal.client.service_client.config.target_host
    command = [
        sys.executable,
        "-m",
        "tests.integration.temporal_app",
        "--address",
        address,
        "--task-queue",
        queue,
        "--marker",
        str(marker),
    ]
    log = (tmp_path / "worker.log").open("wb")
    first = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220
    second: subprocess.Popen[bytes] | None = None
    try:
        async with AlmaWorker.start(settings):
            handle = await temporal.client.start_workflow(
                app.Delivery.run, "invoices", id=f"wf-{uuid.uuid4().hex[:10]}", task_queue=queue
            )

            async def died() -> bool:
                return first.poll() is not None

            await wait_for(died, limit_s=60, what="the worker to kill itself after `plan`")
            assert first.returncode == -9
            assert not marker.exists()
            second = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220
            result = await handle.result()
            run = mapping.run_id(handle.id, handle.result_run_id or "")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        log.close()
    assert result == {
        "topic": "invoices",
        "steps": ["fetch", "write"],
        "draft": "a report on invoices",
    }
    rows = await checkpoints(dsn, run)
    assert [(r["seq"], r["node_id"]) for r in rows] == [(1, "plan"), (2, "write")]
    seen = await events(dsn, run)
    plan_events = [(e["type"], e["payload"].get("attempt")) for e in seen if e["node_id"] == "plan"]
    # attempt 1 started and completed (then the process died), attempt 2 started; its
    # completion is the same event as attempt 1's, so the inbox dropped it
    assert plan_events == [("node.started", 1), ("node.completed", None), ("node.started", 2)]


async def test_a_new_run_resumes_from_where_a_failed_run_stopped(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    async with AlmaWorker.start(settings), temporal_worker(temporal, settings) as queue:
        workflow_id = f"wf-{uuid.uuid4().hex[:10]}"
        first = await temporal.client.start_workflow(
            app.Resumable.run, "", id=workflow_id, task_queue=queue
        )
        with pytest.raises(WorkflowFailureError):
            await first.result()
        second = await temporal.client.start_workflow(
            app.Resumable.run, first.result_run_id, id=workflow_id, task_queue=queue
        )
        resumed = await second.result()
    # the failed run stopped at deliver's failure (seq 3), with plan's and fetch's state
    assert resumed["at"] == ["failure", "deliver", 3]
    assert resumed["state"] == {
        "topic": "parcels",
        "steps": ["fetch", "write"],
        "sources": ["web:parcels"],
        "pages": 3,
    }


async def test_a_replay_publishes_nothing(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    dsn = settings.postgres_dsn or ""
    async with AlmaWorker.start(settings), temporal_worker(temporal, settings) as queue:
        _, run = await run_to_end(temporal.client, app.Research.run, "tides", queue)

        await finished(dsn, run, "succeeded")
        before = await count(dsn, "SELECT count(*) FROM run_events")
        workflow_id = run.split("/")[0]
        history = await temporal.client.get_workflow_handle(workflow_id).fetch_history()
        replayer = Replayer(workflows=app.WORKFLOWS, plugins=[AlmaPlugin(settings)])
        replayed = await replayer.replay_workflow(history, raise_on_replay_failure=True)
        assert replayed.replay_failure is None
    assert await count(dsn, "SELECT count(*) FROM run_events") == before == 7
    # the run's completion is a local activity: a marker, not an activity Temporal schedules
    kinds = [EventType.Name(e.event_type) for e in history.events]
    assert kinds.count("EVENT_TYPE_ACTIVITY_TASK_SCHEDULED") == 3  # plan, fetch, write
    assert kinds.count("EVENT_TYPE_MARKER_RECORDED") == 2  # the patch, alma.complete
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert scheduled == ["plan", "fetch", "write"]


async def test_almas_activities_run_on_the_plugins_task_queue(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    """With the plugin's ``task_queue`` ALMA's activities run on that queue (another
    worker's), so the run's completion is a scheduled activity there, not a local one."""
    dsn = settings.postgres_dsn or ""
    side = f"alma-{uuid.uuid4().hex[:10]}"
    async with (
        AlmaWorker.start(settings),
        Worker(
            temporal.client,
            task_queue=side,
            activities=[],  # the plugin brings ALMA's own
            plugins=[AlmaPlugin(settings, tenant_id="acme")],
        ),
        temporal_worker(temporal, settings, task_queue=side) as queue,
    ):
        _, run = await run_to_end(temporal.client, app.Research.run, "kelp", queue)

        await finished(dsn, run, "succeeded")
        workflow_id = run.split("/")[0]
        history = await temporal.client.get_workflow_handle(workflow_id).fetch_history()
    scheduled = [
        (a.activity_type.name, a.task_queue.name)
        for a in (
            e.activity_task_scheduled_event_attributes
            for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
        )
    ]
    assert scheduled == [
        ("plan", queue),
        ("fetch", queue),
        ("write", queue),
        ("alma.complete", side),
    ]
    kinds = [EventType.Name(e.event_type) for e in history.events]
    assert "EVENT_TYPE_MARKER_RECORDED" not in kinds  # no patch either: nothing local


async def test_a_workflow_from_before_the_local_completion_replays(
    temporal: WorkflowEnvironment, settings: Settings
) -> None:
    """A history recorded by the release before alma.complete ran as a local activity
    (ALMA's completion a scheduled activity, no patch marker) replays on this one: a
    worker upgraded under running workflows meets no nondeterminism. (Recorded from
    Research on 46801e3: keep Research's activities as they are, or record it again.)"""
    dsn = settings.postgres_dsn or ""
    recorded = (HISTORIES / "research-before-local-complete.json").read_text()
    history = WorkflowHistory.from_json("research-before-local-complete", recorded)
    kinds = [EventType.Name(e.event_type) for e in history.events]
    assert kinds.count("EVENT_TYPE_ACTIVITY_TASK_SCHEDULED") == 4  # alma.complete's too
    assert "EVENT_TYPE_MARKER_RECORDED" not in kinds
    before = await count(dsn, "SELECT count(*) FROM run_events")
    replayer = Replayer(workflows=app.WORKFLOWS, plugins=[AlmaPlugin(settings)])
    replayed = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert replayed.replay_failure is None
    assert await count(dsn, "SELECT count(*) FROM run_events") == before


async def test_the_outcome_is_learned_and_retrieved_by_the_next_run(
    temporal: WorkflowEnvironment, settings: Settings, embedder: AsyncEmbedder
) -> None:
    dsn = settings.postgres_dsn or ""
    async with (
        AlmaWorker.start(settings, ("checkpointer", "learner"), embedder),
        temporal_worker(temporal, settings) as queue,
    ):
        _, run = await run_to_end(temporal.client, app.Research.run, "heat pumps", queue)

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 1

        await wait_for(learned, limit_s=60, what="the outcome")
        outcome = await fetch(
            dsn,
            "SELECT run_id, success, node_count, task, strategy FROM workflow_outcomes",
        )
        assert dict(outcome[0]) == {
            "run_id": run,
            "success": True,
            "node_count": 3,
            "task": "write a research report on heat pumps",
            "strategy": "plan → fetch → write",
        }
        # another workflow's activity asks what ALMA learned: its own workflow's scope
        # holds nothing, the Research workflow's holds the run
        prompts, _ = await run_to_end(
            temporal.client, app.Recall.run, "a research report on heat pumps", queue
        )
    assert "Research" not in prompts["own"]
    assert f"Research run {run}: succeeded (3/3 nodes" in prompts["research"]


@pytest.mark.parametrize(
    ("kind", "error_type", "says"),
    [
        ("opaque", "ResultNotJson", "cannot be converted"),
        ("not_a_number", "ResultNotJson", "not JSON"),
        ("too_big", "StateTooLarge", "the limit is 65536"),
        ("reducer_type", "ReducerTypeError", "sum"),  # dead-lettered by the checkpointer
        ("unknown_reducer", "MergeFailed", "unknown_reducer"),
    ],
)
async def test_what_alma_refuses_fails_the_workflow_clearly(
    temporal: WorkflowEnvironment, settings: Settings, kind: str, error_type: str, says: str
) -> None:
    dsn = settings.postgres_dsn or ""
    await register_reducers(dsn, "Broken", {"hours": "sum"})
    async with (
        AlmaWorker.start(settings, ("checkpointer", "joiner")),
        temporal_worker(temporal, settings) as queue,
    ):
        with pytest.raises(WorkflowFailureError) as failed:
            await run_to_end(temporal.client, app.Broken.run, kind, queue)
        activity_error = failed.value.cause
        assert isinstance(activity_error, ActivityError)
        cause = activity_error.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == error_type
        assert cause.non_retryable
        assert says in cause.message
        assert str(cause).count(error_type) == 1, str(cause)  # "Type: message", once

        async def failed_run() -> list[Any]:
            return await fetch(dsn, "SELECT run_id, status FROM runs WHERE status = 'failed'")

        rows = await wait_for(failed_run, what="the failed run")
    seen = await events(dsn, rows[0]["run_id"])
    assert seen[-1]["type"] == "workflow.completed"
    assert seen[-1]["payload"]["outcome"] == "failure"
    assert error_type in seen[-1]["payload"]["error_message"]
    assert f"{error_type}: {error_type}" not in seen[-1]["payload"]["error_message"]


@pytest.mark.slow
async def test_the_agtestari_example_runs(
    temporal: WorkflowEnvironment, settings: Settings, embedder: AsyncEmbedder, tmp_path: Path
) -> None:
    """examples/agtestari_temporal.py against running workers and a Temporal server,
    as a user runs it."""
    example = ROOT / "examples" / "agtestari_temporal.py"
    env = {
        **worker_env(settings),
        "PYTHONPATH": str(ROOT),
        "TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host,
    }
    async with AlmaWorker.start(settings, ("checkpointer", "joiner", "learner"), embedder):
        returncode, text = await run_script(example, env, tmp_path)
    assert returncode == 0, text
    assert "nda-acme: approved, risk 3, ['legal: standard terms', 'finance: risk 2']" in text
    assert "msa-globex: approved, risk 6" in text  # after the approval service's retry
    assert "supplier-initech: failed (unlimited liability clause" in text
    lessons = text.partition("what ALMA learned for the next supplier contract:")[2]
    # relevance first: the failure a supplier contract met is what the next one sees first
    assert "## Past runs that failed" in lessons
    assert "unlimited liability clause" in lessons.partition("## Past runs that worked")[0]
    assert "## Past runs that worked" in lessons
    dsn = settings.postgres_dsn or ""
    statuses = await fetch(dsn, "SELECT status, count(*) AS n FROM runs GROUP BY status")
    # four reviews (one failed) and the run that asked for lessons
    assert {r["status"]: r["n"] for r in statuses} == {"succeeded": 4, "failed": 1}


@pytest.mark.parametrize("fails", ["kafka", "reducers"])
async def test_a_worker_whose_plugin_cannot_start_leaves_nothing_open(
    temporal: WorkflowEnvironment, settings: Settings, fails: str
) -> None:
    """The plugin's client cannot reach Kafka, or its reducers cannot be registered
    (PostgreSQL refuses the connection): the worker does not start, the error says what
    to do, and no producer or pool is left open for the garbage collector to find."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    if fails == "kafka":
        broken, expected = (
            settings.model_copy(update={"kafka_bootstrap": closed}),
            "cannot reach Kafka",
        )
    else:
        broken = settings.model_copy(update={"postgres_dsn": f"postgresql://alma@{closed}/alma"})
        expected = "cannot connect to PostgreSQL"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = Worker(
            temporal.client,
            task_queue=f"q-{uuid.uuid4().hex[:10]}",
            workflows=app.WORKFLOWS,
            activities=app.ACTIVITIES,
            plugins=[AlmaPlugin(broken, tenant_id="acme", reducers={"Broken": {"hours": "sum"}})],
        )
        with pytest.raises(errors.AlmaError, match=expected):
            await asyncio.wait_for(worker.run(), 60)
        del worker
        gc.collect()
    assert not [w for w in caught if "Unclosed" in str(w.message)], [str(w.message) for w in caught]
