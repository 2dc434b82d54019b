"""The orchestrator's side end to end on the real stack: hooks and the DAG orchestrator
(publish → checkpoint → merge reply → outcome → retrieval), RunState under concurrent
writers, and an orchestrator crash resumed from the latest checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from alma_core import errors
from alma_core.cli.demo_workflows import research
from alma_core.consumers.metrics import Metrics
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.dag import Orchestrator, SimulatedCrash
from alma_core.sdk.hooks import WorkflowHooks
from alma_core.sdk.run_state import RunState
from alma_core.settings import Settings
from alma_core.storage import effects
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.types import RetrievalScope, WorkflowContext
from tests.integration.harness import Worker, count, fetch, wait_for, worker_env

# plan 120 + searches (web 330, papers 360, news 340) + draft 900, summed
EXPECTED_TOKENS = 120 + 330 + 360 + 340 + 900


def ctx(run: str, tenant: str = "acme") -> WorkflowContext:
    return WorkflowContext(tenant, "research-report", "v1", run)


async def test_orchestrator_end_to_end(settings: Settings, embedder: AsyncEmbedder) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    seen = Metrics()  # what a process that serves reads exports
    async with (
        Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder),
        AlmaClient(settings, embedder=embedder, observer=seen) as client,
    ):
        orch = Orchestrator(WorkflowHooks(client))
        results = []
        for i in range(5):
            wf = research(flaky=i == 1, broken=i >= 3)
            results.append(
                await orch.run(
                    wf, ctx(f"sdk-{i}"), task="report on heat pumps", state={"topic": "heat pumps"}
                )
            )
        assert [r.success for r in results] == [True, True, True, False, False]
        assert "citation checker timed out" in (results[3].error or "")
        for r in results[:3]:
            point = await client.resume(ctx(r.run_id))
            assert point.state == r.state  # what the orchestrator saw is what is durable
            assert point.state["sources"] == [
                "web:heat pumps",
                "papers:heat pumps",
                "news:heat pumps",
            ]
            assert point.state["tokens"] == EXPECTED_TOKENS
            assert point.state["confidence"] == 0.8
            assert point.state["approved"] is True
        assert await count(dsn, "SELECT count(*) FROM joins WHERE status = 'ok'") == 5
        # the flaky draft failed once and was retried: a failure checkpoint, then the node
        kinds = await fetch(
            dsn,
            "SELECT kind FROM checkpoints WHERE run_id = 'sdk-1' "
            "AND node_id = 'draft' ORDER BY seq",
        )
        assert [k["kind"] for k in kinds] == ["failure", "node"]

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 5

        await wait_for(learned, limit_s=60, what="five outcomes")
        outcome = await fetch(
            dsn,
            "SELECT success, node_count, nodes_succeeded, nodes_failed "
            "FROM workflow_outcomes WHERE run_id = 'sdk-3'",
        )
        # plan, 3 searches, the join, draft, review (failed)
        assert dict(outcome[0]) == {
            "success": False,
            "node_count": 7,
            "nodes_succeeded": 6,
            "nodes_failed": 1,
        }
        found = await client.retrieve(
            "write a report on heat pumps", ctx("x"), RetrievalScope.WORKFLOW
        )
        assert found.anti_patterns
        assert "citation checker" in found.anti_patterns[0].content
        assert found.heuristics
        assert found.heuristics[0].successes == 3
        assert "Mistakes to avoid" in found.to_prompt(max_tokens=400)
        retrievals = seen.registry.get_sample_value(
            "alma_retrieval_seconds_count", {"scope": "workflow", "plan": "exact"}
        )
        assert retrievals == 1
        other = await client.retrieve("heat pumps", ctx("x", tenant="globex"))
        assert other.empty  # another tenant sees nothing of acme's


async def test_run_state_concurrent_writers_lose_nothing(settings: Settings) -> None:
    async with (
        Worker.start(settings, ("checkpointer",)),
        AlmaClient(settings) as a,
        AlmaClient(settings) as b,
    ):
        run = WorkflowContext("acme", "planner", None, "state-run")
        writers = [RunState(c, run, counters=("steps",)) for c in (a, b, a, b)]
        await asyncio.gather(
            *(
                op
                for w, st in enumerate(writers)
                for i in range(10)
                for op in (st.increment("steps"), st.record_action(f"w{w}-{i}"))
            )
        )
        state = RunState(a, run, counters=("steps",))
        assert await state.get("steps") == 40
        actions = await state.actions()
        assert sorted(actions) == sorted(f"w{w}-{i}" for w in range(4) for i in range(10))
        assert not await state.has("approved")
        seq = await state.set("approved", True)
        assert await state.has("approved")
        assert state.seq == seq
        with pytest.raises(errors.StaleExpectedSeq, match="the event expected"):
            await state.set("approved", False, expected_seq=(seq or 0) - 1)
        assert await state.get("approved") is True
        with pytest.raises(errors.ContextError, match="not a counter"):
            await state.increment("approved")
        with pytest.raises(errors.ContextError, match="is a counter"):
            await state.set("steps", 0)
        clash = RunState(a, run, lists=("steps",))
        with pytest.raises(errors.ConfigError, match="already uses reducers"):
            await clash.append("steps", 1)


async def test_orchestrator_crash_resumes_from_latest_checkpoint(settings: Settings) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    wf = research(flaky=False, broken=False)
    run = ctx("crash-run")
    async with Worker.start(settings, ("checkpointer", "joiner")):
        async with AlmaClient(settings) as first:
            with contextlib.suppress(SimulatedCrash):
                await Orchestrator(WorkflowHooks(first)).run(
                    wf, run, task="t", state={"topic": "wind"}, crash_after="gather"
                )
        async with AlmaClient(settings) as second:  # a new orchestrator process
            hooks = WorkflowHooks(second)
            result = await Orchestrator(hooks).resume(wf, run, task="t")
    assert result.success
    assert result.resumed_after == "gather"
    assert result.state["tokens"] == EXPECTED_TOKENS
    rows = await fetch(
        dsn,
        "SELECT node_id, count(*) AS n FROM checkpoints "
        "WHERE run_id = 'crash-run' GROUP BY node_id",
    )
    # nothing before the crash ran twice; everything after ran once
    assert {r["node_id"]: r["n"] for r in rows} == {
        "start": 1,
        "plan": 1,
        "search-web": 1,
        "search-papers": 1,
        "search-news": 1,
        "gather": 1,
        "draft": 1,
        "review": 1,
    }
    status = await fetch(dsn, "SELECT status FROM runs WHERE run_id = 'crash-run'")
    assert status[0]["status"] == "succeeded"


async def test_applied_times_out_with_advice_and_the_write_still_lands(
    settings: Settings,
) -> None:
    """A timeout does not mean the write is lost: the event is published, and once a
    checkpointer runs it takes effect; the error says so, and to ask again."""
    async with AlmaClient(settings) as client:  # no checkpointer running
        run = WorkflowContext("acme", "wf", None, "nobody-home", "n")
        event_id = await client.node_completed(run, updates={"a": 1})
        with pytest.raises(errors.EffectTimeout, match="checkpointer runs") as info:
            await client.applied(run, event_id, timeout=0.5)
        assert "may still take effect" in info.value.message
        assert "call applied() again with this event id" in info.value.message
        async with Worker.start(settings):
            assert (await client.applied(run, event_id, timeout=30)).seq == 1


@pytest.mark.slow
async def test_the_dag_orchestrator_example_runs(
    settings: Settings, embedder: AsyncEmbedder, tmp_path: Path
) -> None:
    """examples/dag_orchestrator.py against running workers, as a user runs it."""
    example = Path(__file__).parents[2] / "examples" / "dag_orchestrator.py"
    env = {
        **worker_env(settings),
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "ALMA_DATA_DIR": str(tmp_path),
    }
    async with Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder):
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(example)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum("success=True" in line for line in lines) == 4, result.stdout
    assert any("resumed after 'prepare', success=True" in line for line in lines)
    assert "'cost': 1.5" in result.stdout  # summed over the two branches
    assert "Past runs that worked" in result.stdout


async def test_applied_wakes_on_the_commit_not_on_a_poll(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """applied() is woken by the checkpointer's notification of the run (each write
    and a rejection), not by its safety re-read (put off past the test here), and the
    client's listening connection is closed with the client."""
    monkeypatch.setattr(effects, "POLL_S", 60.0)
    dsn = settings.postgres_dsn or ""
    listening = "SELECT count(*) AS n FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
    async with Worker.start(settings, ("checkpointer",)), AlmaClient(settings) as client:
        run = WorkflowContext("acme", "wf", None, "notified-run", "n")
        await client.applied(run, await client.node_completed(run, state={"a": 0}), timeout=30)
        listener = client.waiter.listening
        assert listener is not None
        assert listener.alive
        before, early = listener.wakeups, listener.early
        for i in range(1, 6):
            event_id = await client.node_completed(run, state={"a": i})
            applied = await client.applied(run, event_id, timeout=10)
            assert (applied.effect, applied.seq) == ("checkpointed", i + 1)
        stale = await client.node_completed(run, state={"a": 9}, expected_seq=1)
        with pytest.raises(errors.StaleExpectedSeq):
            await client.applied(run, stale, timeout=10)
        # one wake-up per write at least (none if the commit did not notify)
        assert listener.wakeups - before >= 6
        # each run watched from before its publish: no read before the first wait
        assert listener.early - early == 6
        # an event applied before applied() is called: its notification was kept
        event_id = await client.node_completed(run, state={"a": 10})
        await wait_for(lambda: _recorded(dsn, event_id), limit_s=10, what="the event applied")
        applied = await client.applied(run, event_id, timeout=10)
        assert (applied.effect, applied.seq) == ("checkpointed", 7)
        assert listener.early - early == 7
        assert (await fetch(dsn, listening))[0]["n"] >= 1
    await wait_for(
        lambda: _none_listening(dsn, listening),
        limit_s=10,
        what="the client's LISTEN connection to close with the client",
    )


async def _recorded(dsn: str, event_id: str) -> bool:
    sql = "SELECT count(*) AS n FROM run_events WHERE event_id = $1"
    return (await fetch(dsn, sql, event_id))[0]["n"] == 1


async def _none_listening(dsn: str, sql: str) -> bool:
    return (await fetch(dsn, sql))[0]["n"] == 0


async def test_without_notifications_applied_polls(settings: Settings) -> None:
    """ALMA_NOTIFY_EFFECTS=false on workers and clients: no notification is sent or
    listened for, and applied() still returns every effect (it polls)."""
    quiet = settings.model_copy(update={"notify_effects": False})
    dsn = settings.postgres_dsn or ""
    listening = "SELECT count(*) AS n FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
    heard: list[str] = []
    spy = await asyncpg.connect(dsn)  # would hear the worker's notifications, if any
    await spy.add_listener(effects.CHANNEL, lambda *args: heard.append(args[-1]))
    try:
        async with Worker.start(quiet, ("checkpointer",)), AlmaClient(quiet) as client:
            run = WorkflowContext("acme", "wf", None, "polled-run", "n")
            for i in range(3):
                event_id = await client.node_completed(run, state={"a": i})
                applied = await client.applied(run, event_id, timeout=30)
                assert (applied.effect, applied.seq) == ("checkpointed", i + 1)
            assert client.waiter.listening is None
            assert (await fetch(dsn, listening))[0]["n"] == 1  # the spy alone
    finally:
        await spy.close()
    assert heard == [], "the worker notified with ALMA_NOTIFY_EFFECTS=false"


async def test_a_lone_surrogate_is_refused_before_sending_with_where_it_is(
    settings: Settings,
) -> None:
    """Issue 51, item 11: text no UTF-8 can carry is a clear error naming its place (not
    pydantic's serialization error), nothing is sent, and the client goes on."""
    ctx = WorkflowContext("acme", "wf", None, "surrogate-run", "n")
    async with Worker.start(settings, ("checkpointer",)), AlmaClient(settings) as client:
        with pytest.raises(errors.ContextError, match=r"text at /state/notes/1 .*lone surrogate"):
            await client.node_completed(ctx, state={"notes": ["ok", "half \ud83d"]})
        done = await client.node_completed(ctx, state={"notes": ["ok", "whole \U0001f600"]})
        effect = await client.applied(ctx, done)
    assert effect.seq == 1  # the refused event never reached the run
