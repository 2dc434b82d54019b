"""ALMA Stream driven by LangGraph: AlmaSaver as a graph's checkpointer, the real
broker, PostgreSQL and Redis behind it, the checkpointer applying the writes.

What must hold: LangGraph's own conformance suite for checkpoint savers passes, base
and extended capabilities; a real graph (fan-out with Send, a reducer, an interrupt)
runs, resumes and lists its history as it does on LangGraph's Postgres saver; a
process killed mid-graph resumes from its last checkpoint; a finished thread's outcome
is learned; and what the pipeline refuses raises at the write, never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypedDict

import asyncpg
import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import Capability
from langgraph.checkpoint.conformance.report import ProgressCallbacks
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command

from alma_core import errors
from alma_core.integrations.langgraph import AlmaSaver
from alma_core.integrations.langgraph.saver import Wait
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage import graphs
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.types import WorkflowContext
from tests.integration import langgraph_app as app
from tests.integration.harness import Worker as AlmaWorker
from tests.integration.harness import count, fetch, plan_nodes, run_script, wait_for, worker_env

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("wait", ["applied", "published"])
async def test_langgraph_conformance_suite_passes(
    settings: Settings, worker: AlmaWorker, wait: Wait
) -> None:
    """LangGraph's own suite for savers, every capability; with ``wait="published"``
    the saver's reads wait for its writes, so the suite sees the same."""
    async with AlmaClient(settings) as client:

        @checkpointer_test(name=f"AlmaSaver-{wait}")
        async def saver() -> AsyncIterator[AlmaSaver]:
            yield AlmaSaver(client, tenant_id="acme", workflow_id="conformance", wait=wait)

        report = await validate(saver, progress=ProgressCallbacks.verbose())
    failures = {
        name: result.failures for name, result in report.results.items() if not result.passed
    }
    assert failures == {}
    # every capability, base and extended, was detected and ran its tests
    ran = {name: (r.detected, r.tests_passed) for name, r in report.results.items()}
    assert all(detected and passed > 0 for detected, passed in ran.values()), ran
    assert set(ran) == {c.value for c in Capability}
    assert report.passed_all_base()


async def test_the_reference_passes_the_same_suite(empty_database: str) -> None:
    """AsyncPostgresSaver on the same PostgreSQL, for docs/langgraph.md's comparison: the
    suite's verdict on the saver most LangGraph teams run (if a release adds the missing
    capabilities, update the docs and this list)."""

    @checkpointer_test(name="AsyncPostgresSaver")
    async def reference() -> AsyncIterator[AsyncPostgresSaver]:
        async with postgres_saver(empty_database) as saver:
            yield saver

    report = await validate(reference)
    ran = {name: (r.detected, r.passed, r.tests_passed) for name, r in report.results.items()}
    assert report.passed_all_base(), ran
    # what it implements passes; it has no delete_for_runs or copy_thread (3.2), AlmaSaver does
    assert all(passed and n > 0 for detected, passed, n in ran.values() if detected), ran
    assert sorted(n for n, (detected, _, _) in ran.items() if not detected) == [
        "copy_thread",
        "delete_for_runs",
    ]


# --- a real graph ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def postgres_saver(dsn: str) -> AsyncIterator[AsyncPostgresSaver]:
    """LangGraph's own Postgres saver, the reference, on a database of its own."""
    async with AsyncPostgresSaver.from_conn_string(dsn) as saver:
        await saver.setup()
        yield saver


async def drive(graph: Any, thread: str, durability: str) -> tuple[Any, dict[str, Any]]:
    """Run the graph to its interrupt, approve, run it to the end: what the human was
    asked, and the final state."""
    first = await graph.ainvoke({"task": "survey"}, app.config(thread), durability=durability)
    asked = first["__interrupt__"][0].value
    final = await graph.ainvoke(Command(resume=True), app.config(thread), durability=durability)
    return asked, final


async def history(graph: Any, thread: str) -> list[tuple[Any, ...]]:
    """The thread's checkpoints, newest first: step, source, next nodes, values."""
    return [
        (s.metadata["step"], s.metadata["source"], s.next, s.values)
        async for s in graph.aget_state_history(app.config(thread))
    ]


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
@pytest.mark.parametrize("wait", ["applied", "published"])
async def test_a_graph_runs_as_on_langgraphs_postgres_saver(
    settings: Settings, worker: AlmaWorker, empty_database: str, durability: str, wait: Wait
) -> None:
    """Fan-out with Send, a reducer, an interrupt and its resume: the same answers, the
    same final state, the same history as on AsyncPostgresSaver, in every durability
    mode; and the state right after ``ainvoke`` returns is the final one."""
    thread = f"t-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client, postgres_saver(empty_database) as reference:
        ours = app.build(AlmaSaver(client, tenant_id=app.TENANT, workflow_id=app.GRAPH, wait=wait))
        theirs = app.build(reference)
        asked, final = await drive(ours, thread, durability)
        assert (asked, final) == await drive(theirs, thread, durability)
        assert final == {
            "task": "survey",
            "items": ["survey #0", "survey #1", "survey #2"],
            "results": ["done: survey #0", "done: survey #1", "done: survey #2"],
            "approved": True,
            "summary": "3 results, approved",
        }
        state = await ours.aget_state(app.config(thread))  # read-your-writes
        assert (state.values, state.next) == (final, ())
        ours_history = await history(ours, thread)
        assert ours_history == await history(theirs, thread)
    stored = await count(
        settings.postgres_dsn or "",
        "SELECT count(*) FROM graph_checkpoints WHERE tenant_id = $1 AND thread_id = $2",
        app.TENANT,
        thread,
    )
    assert stored == len(ours_history) > 0  # ALMA's tables hold what the graph read


async def test_a_process_killed_mid_graph_resumes_from_alma(
    settings: Settings, worker: AlmaWorker, empty_database: str, tmp_path: Path
) -> None:
    """A process dies inside a fan-out, after two of the three Send tasks finished. The
    graph resumed from ALMA in another process runs only the task that did not finish
    (the others' writes were kept) and ends in the state the same graph reaches on
    AsyncPostgresSaver without a crash."""
    thread, log = f"t-{uuid.uuid4().hex[:8]}", tmp_path / "work.log"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.integration.langgraph_app",
        thread,
        str(log),
        "survey #1",
        cwd=ROOT,
        env=worker_env(settings),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 9, out.decode()[-3000:]
    assert sorted(log.read_text().split("\n")[:-1]) == ["survey #0", "survey #1", "survey #2"]

    async with AlmaClient(settings) as client, postgres_saver(empty_database) as reference:
        resumed = app.build(AlmaSaver(client, tenant_id=app.TENANT, workflow_id=app.GRAPH), log=log)
        left = await resumed.aget_state(app.config(thread))
        assert left.next == ("work",)  # the fan-out's step, where the process died
        # the finished tasks' writes were kept (LangGraph shows them applied)
        assert sorted(left.values["results"]) == ["done: survey #0", "done: survey #2"]
        first = await resumed.ainvoke(None, app.config(thread))
        assert log.read_text().split("\n")[:-1][3:] == ["survey #1"]  # only the lost task
        assert "__interrupt__" in first
        final = await resumed.ainvoke(Command(resume=True), app.config(thread))
        _, expected = await drive(app.build(reference), thread, "sync")
    assert final == expected


# --- what LangGraph cannot do: learn from finished threads ---------------------------


async def test_finished_threads_are_learned_and_retrieved_by_the_next(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    """A thread that ran to the end and one whose ``work`` task failed: each thread's
    outcome (its nodes, from the tasks' writes; the failing node and error) is learned,
    and the next thread of the graph retrieves both."""
    dsn = settings.postgres_dsn or ""
    good, bad = f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"
    async with (
        AlmaWorker.start(settings, ("checkpointer", "learner"), embedder),
        AlmaClient(settings, embedder=embedder) as client,
    ):
        saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id=app.GRAPH)
        await drive(app.build(saver), good, "sync")
        await saver.acomplete(good, task="survey heat pump suppliers")
        with pytest.raises(RuntimeError, match="timed out"):
            await app.build(saver, fail_item="survey #2").ainvoke(
                {"task": "survey"}, app.config(bad)
            )
        await saver.acomplete(bad, task="survey heat pump installers")

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 2

        await wait_for(learned, limit_s=60, what="both outcomes")
        outcomes = await fetch(
            dsn,
            """SELECT run_id, success, node_count, nodes_failed, failing_node, strategy
               FROM workflow_outcomes ORDER BY success DESC""",
        )
        recalled = await client.retrieve(
            "survey heat pump manufacturers",
            WorkflowContext(tenant_id=app.TENANT, workflow_id=app.GRAPH),
        )
    assert [dict(o) for o in outcomes] == [
        {
            "run_id": good,
            "success": True,
            "node_count": 4,
            "nodes_failed": 0,
            "failing_node": None,
            "strategy": "plan → work → review → finish",
        },
        {
            "run_id": bad,
            "success": False,
            "node_count": 2,
            "nodes_failed": 1,
            "failing_node": "work",
            "strategy": "plan → work",
        },
    ]
    prompt = recalled.to_prompt()
    assert good in prompt
    assert bad in prompt
    assert "RuntimeError" in prompt


# --- what the pipeline refuses ----------------------------------------------------------


async def test_what_the_pipeline_refuses_raises_at_the_write(
    settings: Settings, worker: AlmaWorker
) -> None:
    """A thread another graph owns, and a checkpoint over the record limit: the graph's
    call raises the reason (a dead-lettered event's, or before sending), never hangs,
    and the thread keeps what it had."""
    thread = f"t-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client:
        mine = app.build(AlmaSaver(client, tenant_id=app.TENANT, workflow_id=app.GRAPH))
        await mine.ainvoke({"task": "survey"}, app.config(thread))
        before = await history(mine, thread)

        other = app.build(AlmaSaver(client, tenant_id=app.TENANT, workflow_id="other-graph"))
        with pytest.raises(
            errors.ContextError, match=r"belongs to graph \(workflow\) 'agent-graph'"
        ):
            await other.ainvoke({"task": "survey"}, app.config(thread))  # at its first read

        # published: the write returns, the saver's next read raises the reason, once
        # (then the read itself is refused: the thread is another graph's)
        saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id="other", wait="published")
        await saver.aput_writes(_at(thread, "cp"), [("note", 1)], "task", "")
        with pytest.raises(errors.RejectedEvent, match="belongs to workflow 'agent-graph'"):
            await saver.aget_tuple(app.config(thread))
        with pytest.raises(errors.ContextError, match="belongs to graph"):
            await saver.aget_tuple(app.config(thread))

        # published, and the process ends right after the write: the refusal raises on exit
        with pytest.raises(errors.RejectedEvent, match="belongs to workflow 'agent-graph'"):
            async with AlmaSaver.from_settings(
                settings, tenant_id=app.TENANT, workflow_id="other", wait="published"
            ) as leaving:
                await leaving.aput_writes(_at(thread, "cp"), [("note", 1)], "task", "")

        huge = "x" * (settings.max_record_bytes + 1)
        with pytest.raises(errors.RecordTooLarge, match="ALMA_MAX_RECORD_BYTES"):
            await mine.ainvoke(Command(resume=True, update={"task": huge}), app.config(thread))
        assert await history(mine, thread) == before


async def test_the_cli_sees_a_thread_and_its_deletion(
    settings: Settings, worker: AlmaWorker
) -> None:
    """`alma checkpoints` and `alma resume` on a LangGraph thread show its LangGraph
    checkpoints (not "none"); `alma runs list` says it is a thread, and that it was
    deleted once `adelete_thread` ran (instead of "running")."""
    from tests.integration.test_cli import alma
    from tests.integration.test_cli_runs import env_of

    thread = f"cli-{uuid.uuid4().hex[:8]}"
    env = env_of(settings)

    def cli(*args: str) -> Any:
        done = alma(*args, "--tenant", app.TENANT, "--json", env=env)
        assert done.returncode == 0, (args, done.stderr)
        return json.loads(done.stdout)

    async with AlmaClient(settings) as client:
        saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id=app.GRAPH)
        graph = app.build(saver)
        await graph.ainvoke({"task": "survey"}, app.config(thread))
        state = await graph.aget_state(app.config(thread))
        listed = await asyncio.to_thread(cli, "checkpoints", thread)
        assert len(listed) == len(await history(graph, thread))
        assert listed[0]["checkpoint_id"] == state.config["configurable"]["checkpoint_id"]
        resumed = await asyncio.to_thread(cli, "resume", thread)
        assert resumed["langgraph"]["checkpoint_id"] == listed[0]["checkpoint_id"]
        assert resumed["langgraph"]["step"] == state.metadata["step"]
        (row,) = [r for r in await asyncio.to_thread(cli, "runs", "list") if r["run_id"] == thread]
        assert (row["kind"], row["status"]) == ("thread", "running")
        await saver.adelete_thread(thread)
    (row,) = [r for r in await asyncio.to_thread(cli, "runs", "list") if r["run_id"] == thread]
    assert (row["kind"], row["status"]) == ("thread", "deleted")
    deleted = await asyncio.to_thread(cli, "runs", "list", "--status", "deleted")
    assert [r["run_id"] for r in deleted] == [thread]


async def test_synchronous_code_gets_a_saver_on_a_loop_of_its_own(
    settings: Settings, worker: AlmaWorker
) -> None:
    """`graph.invoke` from synchronous code: `from_settings_sync` runs the client on an
    event loop of its own; `setup()` is there as on LangGraph's savers; a client built
    outside any loop says what to use instead of aiokafka's bare RuntimeError."""
    thread = f"sync-{uuid.uuid4().hex[:8]}"

    def counting(saver: AlmaSaver) -> Any:
        graph = StateGraph(Count)
        graph.add_node("one", lambda state: {"n": state["n"] + 1})
        graph.add_node("two", lambda state: {"n": state["n"] * 10})
        graph.add_edge(START, "one")
        graph.add_edge("one", "two")
        graph.add_edge("two", END)
        return graph.compile(checkpointer=saver)

    def synchronous() -> dict[str, Any]:
        with pytest.raises(errors.ConfigError, match="from_settings_sync"):
            AlmaClient(settings)
        with AlmaSaver.from_settings_sync(
            settings, tenant_id=app.TENANT, workflow_id="counting"
        ) as saver:
            saver.setup()
            graph = counting(saver)
            assert graph.invoke({"n": 1}, app.config(thread)) == {"n": 20}
            return dict(graph.get_state(app.config(thread)).values)

    assert await asyncio.to_thread(synchronous) == {"n": 20}
    async with AlmaClient(settings) as client:  # what it wrote, read from this loop
        saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id="counting")
        assert (await counting(saver).aget_state(app.config(thread))).values == {"n": 20}


class Count(TypedDict):
    n: int


async def test_a_thread_id_alma_cannot_keep_is_refused_naming_it_and_the_limit(
    settings: Settings, worker: AlmaWorker
) -> None:
    """A thread is an ALMA run, whose id is 1 to 256 characters: an empty or a longer
    thread id is refused for writes and reads alike, with the thread and the limit named,
    before anything is sent."""
    async with AlmaClient(settings) as client:
        graph = app.build(AlmaSaver(client, tenant_id=app.TENANT, workflow_id=app.GRAPH))
        for thread, shown in (("", "thread_id '' (0 characters)"), ("t" * 300, "(300 characters)")):
            with pytest.raises(errors.ContextError, match=re.escape(shown)) as write:
                await graph.ainvoke({"task": "survey"}, app.config(thread))
            assert "1 to 256 characters" in write.value.message
            with pytest.raises(errors.ContextError, match="1 to 256 characters"):
                await graph.aget_state(app.config(thread))
        fits = "t" * 256
        await graph.ainvoke({"task": "survey"}, app.config(fits))  # the longest id kept
        assert (await graph.aget_state(app.config(fits))).next == ("review",)


@pytest.mark.slow
async def test_the_langgraph_example_runs(
    settings: Settings, embedder: AsyncEmbedder, tmp_path: Path
) -> None:
    """examples/langgraph_agent.py against running workers, as a user runs it."""
    env = {**worker_env(settings), "PYTHONPATH": str(ROOT)}
    async with AlmaWorker.start(settings, ("checkpointer", "learner"), embedder):
        returncode, text = await run_script(ROOT / "examples" / "langgraph_agent.py", env, tmp_path)
    assert returncode == 0, text
    assert "the human is asked: 3 findings on heat pumps" in text
    assert "'heat pumps in news'; 3 results for 'heat pumps in papers'" in text
    assert "(published)" in text
    assert "failed (search 'heat pump patents in " in text  # the patents thread
    assert "what ALMA learned for the next thread" in text
    assert "research-agent run heat-pumps-" in text


# --- a saver under load and faults -----------------------------------------------------

_SEND = "~__pregel_push, 0, False"  # the task path of a Send's first task


def _at(thread: str, checkpoint_id: str) -> Any:
    return {
        "configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": checkpoint_id}
    }


def _first(thread: str) -> Any:
    """The config of a thread's first ``aput``: no checkpoint before it."""
    return {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}


def _checkpoint(checkpoint_id: str) -> Any:
    return {
        "v": 1,
        "id": checkpoint_id,
        "ts": "2026-11-26T00:00:00+00:00",
        "channel_values": {},
        "channel_versions": {},
        "versions_seen": {},
    }


async def test_send_tasks_waiting_for_checkpoints_are_never_cancelled_or_stalled(
    settings: Settings, worker: AlmaWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Send task learns its node from its checkpoint's ``aput``, which with
    ``durability="async"`` may begin after the task finished. A task whose checkpoint's
    ``aput`` is not coming (nothing of the thread in flight in this saver: the save
    chain broke) writes at once, not after a fixed wait. More tasks wait than the saver
    remembers checkpoints for, while a save is held up (its partition's offset row
    locked by another session): the oldest wait is let go with no node, never cancelled
    (the graph's task would die of a CancelledError nobody asked for)."""
    from alma_core.integrations.langgraph import saver as saver_mod
    from alma_core.integrations.langgraph.saver import _SENDS_KEPT
    from tests.integration.test_overlapping_faults import offset_rows_locked

    # the cap on one wait (5 s) is not what this test is about: the 1,025 tasks must all
    # be waiting at once, which a loaded machine may take longer than 5 s to reach (the
    # test lasts about this cap: the waits end by it once the held save is through)
    monkeypatch.setattr(saver_mod, "_SEND_WAIT_S", 15.0)

    thread = f"t-{uuid.uuid4().hex[:8]}"
    dsn = settings.postgres_dsn or ""
    async with AlmaClient(settings) as client:
        saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id="sends")
        write = saver.aput_writes(_at(thread, "never-put"), [("found", ["a"])], "task", _SEND)
        await asyncio.wait_for(write, 2.0)  # applied, in well under the old 5 s wait
        group = f"{settings.group_prefix}-checkpointer"
        async with offset_rows_locked(dsn, group, list(range(4))):
            held = asyncio.create_task(saver.aput(_first(thread), _checkpoint("held"), {}, {}))
            await asyncio.sleep(0)  # its aput has begun (the save in flight)
            waiting = [
                asyncio.create_task(
                    saver.aput_writes(_at(thread, f"cp-{i}"), [("found", [i])], f"t{i}", _SEND)
                )
                for i in range(_SENDS_KEPT + 1)
            ]

            async def all_waiting() -> bool:
                return len(saver._announced) == len(waiting)

            await wait_for(all_waiting, what="every Send task waiting for its checkpoint")
            evicting = asyncio.create_task(saver.aput(_first(thread), _checkpoint("new"), {}, {}))
            await asyncio.sleep(0.2)
            assert not any(w.done() and w.cancelled() for w in waiting)
        outcomes = await asyncio.wait_for(
            asyncio.gather(held, evicting, *waiting, return_exceptions=True), 90
        )
        assert [o for o in outcomes if isinstance(o, BaseException)] == []


async def test_a_thread_only_written_keeps_a_bounded_record_of_its_writes(
    settings: Settings, worker: AlmaWorker
) -> None:
    """``wait="published"`` remembers each write of a thread until the saver sees it
    applied, to make its own reads wait for them. A thread this saver only writes (a
    producer of events, read elsewhere) must not make that memory grow without end."""
    from alma_core.integrations.langgraph.saver import _PENDING_KEPT

    thread = f"t-{uuid.uuid4().hex[:8]}"
    dsn = settings.postgres_dsn or ""
    writes = 3 * _PENDING_KEPT
    async with AlmaClient(settings) as client:
        saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id="writer", wait="published")
        for i in range(writes):
            await saver.aput_writes(_at(thread, "cp"), [("note", i)], f"task-{i}", "")
            assert len(saver._pending.get(thread, ())) <= 2 * _PENDING_KEPT
        assert await saver.aget_tuple(_at(thread, "cp")) is None  # reads wait for it all
        assert thread not in saver._pending
        sql = "SELECT count(*) FROM run_events WHERE run_id = $1"
        assert await count(dsn, sql, thread) == writes


async def test_reading_a_long_thread_looks_up_its_owner_once_whatever_the_runs_stored(
    settings: Settings, worker: AlmaWorker
) -> None:
    """The newest checkpoint of a long thread costs the same with thousands of other
    runs stored: the ownership check is one primary-key lookup of the thread's run. (It
    was a check per row, which PostgreSQL, expecting the thread's many rows, ran as a
    hash of every unreleased run in the database: 42 ms with 100,000 stored.)"""
    thread, others, steps = f"long-{uuid.uuid4().hex[:8]}", f"filler-{uuid.uuid4().hex[:6]}", 300
    dsn = settings.postgres_dsn or ""
    async with AlmaClient(settings) as client:
        saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id=app.GRAPH, wait="published")
        config: Any = _first(thread)
        version: Any = None
        for step in range(steps):
            checkpoint = empty_checkpoint()
            version = saver.get_next_version(version, None)
            checkpoint["channel_values"] = {"scratch": f"step {step}"}
            checkpoint["channel_versions"] = {"scratch": version}
            config = await saver.aput(
                config, checkpoint, {"source": "loop", "step": step}, {"scratch": version}
            )
        latest = await saver.aget_tuple(_first(thread))
        assert latest is not None
        assert latest.checkpoint["id"] == config["configurable"]["checkpoint_id"]
        assert latest.checkpoint["channel_values"] == {"scratch": f"step {steps - 1}"}
    conn = await asyncpg.connect(dsn)
    try:
        # other runs, of another tenant and of this one (another graph's)
        for tenant in (others, app.TENANT):
            await conn.execute(
                """INSERT INTO runs (tenant_id, run_id, workflow_id)
                   SELECT $1, $2 || g, 'other-graph' FROM generate_series(1, 5000) g""",
                tenant,
                f"{others}-run-",
            )
        await conn.execute("ANALYZE runs, graph_checkpoints")  # what autovacuum does in time
        plan = await conn.fetchval(
            f"EXPLAIN (ANALYZE, FORMAT JSON) {graphs.ONE_CHECKPOINT}",
            app.TENANT,
            thread,
            "",
            None,
            app.GRAPH,
        )
    finally:
        await conn.execute("DELETE FROM runs WHERE run_id LIKE $1 || '-run-%'", others)
        await conn.close()
    runs = [n for n in plan_nodes(json.loads(plan)[0]["Plan"]) if n.get("Relation Name") == "runs"]
    assert [(n["Node Type"], n["Actual Loops"]) for n in runs] == [("Index Scan", 1)], runs
    assert runs[0]["Index Name"] == "runs_pkey"


async def test_another_process_never_reads_a_published_writers_thread_stale(
    settings: Settings, worker: AlmaWorker
) -> None:
    """Saver A (``wait="published"``) runs a graph to its interrupt; saver B, with a
    client of its own (as another process), reads the thread the moment A's ``ainvoke``
    returns and resumes it. B waits for A's writes still on their way: it sees A's
    last checkpoint, and its resume ends where the graph ends, every trial."""
    async with AlmaClient(settings) as a_client, AlmaClient(settings) as b_client:
        writer = app.build(
            AlmaSaver(a_client, tenant_id=app.TENANT, workflow_id=app.GRAPH, wait="published")
        )
        reader = app.build(AlmaSaver(b_client, tenant_id=app.TENANT, workflow_id=app.GRAPH))
        for trial in range(4):
            thread = f"x-{trial}-{uuid.uuid4().hex[:8]}"
            await writer.ainvoke({"task": "survey"}, app.config(thread))
            seen = await reader.aget_state(app.config(thread))
            mine = await writer.aget_state(app.config(thread))  # A's own: read-your-writes
            assert (seen.next, seen.config) == (("review",), mine.config), trial
            final = await reader.ainvoke(Command(resume=True), app.config(thread))
            assert final["summary"] == "3 results, approved", trial


async def test_a_thread_is_its_graphs_for_reads_and_writes_until_deleted(
    settings: Settings, worker: AlmaWorker
) -> None:
    """One ownership model: graph B may neither read nor write graph A's thread (the
    read raises naming the owner; B's list leaves it out); once A deletes the thread
    its id is free, as on LangGraph's own savers: B runs it, and now A is refused."""
    thread = f"own-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client:
        a_saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id="graph-a")
        b_saver = AlmaSaver(client, tenant_id=app.TENANT, workflow_id="graph-b")
        a, b = app.build(a_saver), app.build(b_saver)
        await a.ainvoke({"task": "survey"}, app.config(thread))
        with pytest.raises(errors.ContextError, match=r"belongs to graph \(workflow\) 'graph-a'"):
            await b.aget_state(app.config(thread))
        assert thread not in {
            t.config["configurable"]["thread_id"] async for t in b_saver.alist(None)
        }
        with pytest.raises(errors.RejectedEvent, match="belongs to workflow 'graph-a'"):
            await b_saver.aput_writes(_at(thread, "cp"), [("note", 1)], "task", "")

        await a_saver.adelete_thread(thread)
        first = await b.ainvoke({"task": "survey"}, app.config(thread))
        assert "__interrupt__" in first
        final = await b.ainvoke(Command(resume=True), app.config(thread))
        assert final["summary"] == "3 results, approved"
        with pytest.raises(errors.ContextError, match=r"belongs to graph \(workflow\) 'graph-b'"):
            await a.aget_state(app.config(thread))
