"""Chaos: checkpointer processes killed with SIGKILL at random points while several
producers publish (with duplicates); members joining and leaving mid-stream; the
joiner killed with joins in flight; and processes running every group (checkpointer,
joiner, learner) killed, one left dead, with each side effect counted afterwards.
The invariants must hold: one checkpoint per accepted event, seq 1..n per run in
publish order, one answered join and one outcome per run, and the cache never
older than PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from alma_core.settings import Settings
from tests.integration.harness import (
    Publisher,
    Worker,
    WorkerProcess,
    assert_cache_matches,
    assert_exactly_once,
    assert_reads_fresh,
    completed,
    count,
    fetch,
    register_reducers,
    wait_for,
)

pytestmark = pytest.mark.chaos


async def produce(
    settings: Settings,
    runs: list[str],
    steps: int,
    published: dict[str, list[dict[str, Any]]],
    resend: list[dict[str, Any]],
    rng: random.Random,
) -> None:
    """One producer owns its runs, so each run's publish order is well defined."""
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for step in range(steps):
            for run in runs:
                # an appended history: an event applied twice would show as a repeat
                doc = completed(run, node=f"n{step}", updates={"step": step, "history": [step]})
                published.setdefault(run, []).append(doc)
                await pub.send(doc)
                if rng.random() < 0.1:
                    await pub.send(doc)  # a producer retry: same event_id, new offset
                    resend.append(doc)
            await pub.flush()
            await asyncio.sleep(rng.uniform(0.05, 0.25))


async def resend_duplicates(
    settings: Settings, resend: list[dict[str, Any]], done: asyncio.Event
) -> None:
    """Another producer republishes events already sent (an upstream replay)."""
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        while not done.is_set():
            for doc in list(resend[-5:]):
                await pub.send(doc)
            await pub.flush()
            await asyncio.sleep(0.5)


async def test_sigkill_members_at_random_points(settings: Settings, tmp_path: Path) -> None:
    rng = random.Random(1234)
    dsn = settings.postgres_dsn
    assert dsn
    await register_reducers(dsn, "wf", {"history": "append"})
    workers = [WorkerProcess(settings, tmp_path / f"worker-{i}.log").start() for i in range(3)]
    published: dict[str, list[dict[str, Any]]] = {}
    resend: list[dict[str, Any]] = []
    producers_done = asyncio.Event()
    runs = [f"run-{i:02d}" for i in range(24)]
    steps = 25
    try:
        producers = asyncio.gather(
            *(produce(settings, runs[i::3], steps, published, resend, rng) for i in range(3))
        )
        replayer = asyncio.create_task(resend_duplicates(settings, resend, producers_done))
        # Six kills at random moments, while producing and while draining the backlog.
        for _ in range(6):
            await asyncio.sleep(rng.uniform(0.4, 1.5))
            victim = rng.choice(workers)
            victim.kill()
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            victim.start()
        await producers
        producers_done.set()
        await replayer
        total = sum(len(v) for v in published.values())

        async def all_in() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") >= total

        await wait_for(all_in, limit_s=120, what=f"{total} checkpoints")
        await assert_exactly_once(dsn, published)
        # each event folded once: every run's appended history is every step, in order
        finals = await fetch(
            dsn,
            """SELECT DISTINCT ON (run_id) run_id, state FROM checkpoints
               ORDER BY run_id, seq DESC""",
        )
        assert {r["run_id"]: r["state"]["history"] for r in finals} == {
            run: list(range(steps)) for run in runs
        }
        # right away, whatever a killed member left in Redis: readers see PostgreSQL's latest
        await assert_reads_fresh(settings, runs)
        assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0
        for w in workers:  # a member restarted last may still be starting: SIGTERM after
            await w.wait_started()
    finally:
        codes = [w.terminate() for w in workers]
    assert codes == [0, 0, 0], "every member leaves cleanly on SIGTERM"


async def test_members_join_and_leave_mid_stream(settings: Settings, tmp_path: Path) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    rng = random.Random(99)
    published: dict[str, list[dict[str, Any]]] = {}
    runs = [f"r{i}" for i in range(12)]
    async with Worker.start(settings):
        producer = asyncio.create_task(produce(settings, runs, 30, published, [], rng))
        await asyncio.sleep(1.0)
        joiner = WorkerProcess(settings, tmp_path / "joiner.log").start()  # rebalance: join
        await joiner.wait_started(limit_s=120)  # a process still importing dies on SIGTERM
        await asyncio.sleep(3.0)
        assert joiner.terminate() == 0  # rebalance: leave, draining its batch
        second = WorkerProcess(settings, tmp_path / "second.log").start()
        await producer
        total = sum(len(v) for v in published.values())

        async def all_in() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") >= total

        await wait_for(all_in, limit_s=90, what=f"{total} checkpoints")
        # the in-process member may finish everything while the second still imports: a
        # process not yet started exits on SIGTERM's default action (-15), not cleanly
        await second.wait_started(limit_s=120)
        assert second.terminate() == 0
    await assert_exactly_once(dsn, published)


async def test_joiner_killed_mid_stream_every_join_answered_once(
    settings: Settings, tmp_path: Path
) -> None:
    """The joiner SIGKILLed while joins are in flight (some between the merged
    checkpoint and the reply): orchestrators retrying with the same join_id all get
    their answer; each join has exactly one merged checkpoint, durable with the very
    state and seq its reply carries; three fan-out rounds per run merge each write
    once."""
    from alma_core import errors
    from alma_core.sdk.client import AlmaClient
    from alma_core.types import WorkflowContext

    dsn = settings.postgres_dsn
    assert dsn
    rng = random.Random(7)
    runs = [f"j{i}" for i in range(10)]
    rounds = 3

    async def orchestrate(client: AlmaClient, run: str) -> list[Any]:
        """Three rounds of fan-out (branches x and y) and join, as the SDK does them:
        the next round after the join's reply."""
        ctx = WorkflowContext(tenant_id="acme", workflow_id="wf", run_id=run)
        replies = []
        for k in range(rounds):
            for b in ("x", "y"):
                at = WorkflowContext("acme", "wf", None, run, f"work-{b}", b)
                await client.node_completed(at, updates={"log": [f"{b}{k}"]})
            for _ in range(8):
                try:
                    replies.append(
                        await client.merge(
                            ctx,
                            branch_ids=["x", "y"],
                            join_id=f"{run}-{k}",
                            reducers={"log": "append"},
                            timeout=5,
                        )
                    )
                    break
                except errors.MergeTimeout:
                    continue  # the same join_id again: safe
            else:
                raise AssertionError(f"join {run}-{k} never answered")
        return replies

    async with Worker.start(settings):
        joiner = WorkerProcess(settings, tmp_path / "joiner.log", consumers="joiner").start()
        async with AlmaClient(settings) as client:
            asking = asyncio.gather(*(orchestrate(client, run) for run in runs))
            for _ in range(2):
                await asyncio.sleep(rng.uniform(0.3, 1.0))
                joiner.kill()
                await asyncio.sleep(0.3)
                joiner.start()
            by_run = await asyncio.wait_for(asyncio.shield(asking), 120)
        assert joiner.terminate() == 0
    merges = await fetch(
        dsn,
        """SELECT run_id, seq, state, metadata->>'join_id' AS join_id FROM checkpoints
           WHERE kind = 'merge'""",
    )
    durable = {m["join_id"]: m for m in merges}
    assert len(merges) == len(durable) == len(runs) * rounds  # one merge per join
    for run, replies in zip(runs, by_run, strict=True):
        for reply in replies:  # reply after durable: the checkpoint the reply names
            assert reply.status == "ok"
            row = durable[reply.join_id]
            assert (row["run_id"], row["seq"]) == (run, reply.checkpoint_seq)
            assert row["state"] == reply.merged_state
        # each round's writes merged once, in the order given
        assert replies[-1].merged_state == {"log": ["x0", "y0", "x1", "y1", "x2", "y2"]}
        seqs = await fetch(dsn, "SELECT seq FROM checkpoints WHERE run_id = $1 ORDER BY seq", run)
        assert [r["seq"] for r in seqs] == list(range(1, 3 * rounds + 1))  # no gap


async def test_every_group_killed_each_side_effect_once(settings: Settings, tmp_path: Path) -> None:
    """Two worker processes run all three groups (checkpointer, joiner, learner) and are
    SIGKILLed at random points, one left dead for a while, while runs fan out, join and
    complete, with duplicate deliveries. Every side effect is counted afterwards:
    checkpoints and merges once and in order, one answered join with its merge durable
    at the reply's seq, one outcome per run, heuristic counts equal to the outcomes they
    come from, each hand-off present, no dead letter; then the cache is compared with
    PostgreSQL before anything else is written."""
    from tests.integration.harness import event

    rng = random.Random(2026)
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    runs = [f"all-{i:02d}" for i in range(16)]
    workers = [
        WorkerProcess(
            settings, tmp_path / f"all-{i}.log", consumers="checkpointer,joiner,learner"
        ).start()
        for i in range(2)
    ]
    sent: dict[str, list[dict[str, Any]]] = {run: [] for run in runs}

    async def publish() -> None:
        async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
            for run in runs:
                docs = [
                    completed(run, node="a", branch="a", updates={"xs": [f"{run}-a"]}),
                    completed(run, node="b", branch="b", updates={"xs": [f"{run}-b"]}),
                    event(
                        "branch.join",
                        run,
                        node="join",
                        join_id="j",
                        branch_ids=["a", "b"],
                        reducers={"xs": "append"},
                    ),
                    event(
                        "workflow.completed",
                        run,
                        node=None,
                        outcome="success",
                        duration_ms=10,
                        node_count=2,
                        nodes_succeeded=2,
                        nodes_failed=0,
                        task=f"chaos run {run}",
                    ),
                ]
                sent[run] = docs
                for doc in docs:
                    await pub.send(doc)
                    if rng.random() < 0.25:
                        await pub.send(doc)  # a redelivery: same event_id, new offset
                await pub.flush()
                await asyncio.sleep(rng.uniform(0.2, 0.8))

    try:
        for w in workers:  # kills must hit members at work, not ones loading the model
            await w.wait_started(limit_s=120)
        producing = asyncio.create_task(publish())
        for i in range(4):
            victim = workers[i % 2]
            await victim.wait_started(limit_s=120)
            await asyncio.sleep(rng.uniform(0.3, 1.5))
            victim.kill()
            if i < 3:  # the last victim stays dead while the other one carries on
                victim.start()
        await producing
        await asyncio.sleep(3.0)
        workers[1].start()

        async def settled() -> bool:
            joins = await count(dsn, "SELECT count(*) FROM joins")
            outcomes = await count(dsn, "SELECT count(*) FROM workflow_outcomes")
            return joins == len(runs) and outcomes == len(runs)

        await wait_for(settled, limit_s=180, what="every join answered and every run learned")
        # The cache against PostgreSQL first: nothing else has been written since.
        await assert_cache_matches(settings, runs, require_all=False)
        for run, docs in sent.items():
            rows = await fetch(
                dsn,
                "SELECT seq, kind, event_id, state FROM checkpoints WHERE run_id = $1 ORDER BY seq",
                run,
            )
            assert [(r["seq"], r["kind"], r["event_id"]) for r in rows] == [
                (1, "node", docs[0]["event_id"]),
                (2, "node", docs[1]["event_id"]),
                (3, "merge", docs[2]["event_id"]),
            ], run
            assert rows[2]["state"] == {"xs": [f"{run}-a", f"{run}-b"]}
        joins = await fetch(dsn, "SELECT run_id, status, checkpoint_seq, reply FROM joins")
        for j in joins:  # reply after durable: the reply's seq and state are the merge's
            assert (j["status"], j["checkpoint_seq"]) == ("ok", 3), j["run_id"]
            assert j["reply"]["merged_state"] == {"xs": [f"{j['run_id']}-a", f"{j['run_id']}-b"]}
        events = await fetch(dsn, "SELECT event_id, count(*) AS n FROM run_events GROUP BY 1")
        assert sorted(e["event_id"] for e in events) == sorted(
            d["event_id"] for docs in sent.values() for d in docs
        )
        outcomes = await fetch(dsn, "SELECT run_id, event_id FROM workflow_outcomes")
        completions = sorted(docs[3]["event_id"] for docs in sent.values())
        assert sorted(o["event_id"] for o in outcomes) == completions
        # Learned counts are derived from the outcomes, whatever was delivered twice.
        heuristics = await fetch(
            dsn, "SELECT occurrences, successes FROM memories WHERE kind = 'heuristic'"
        )
        assert [(h["occurrences"], h["successes"]) for h in heuristics] == [(len(runs), len(runs))]
        handoffs = await read_topic_ids(bootstrap, settings.sequenced_topic, 2 * len(runs))
        assert handoffs == {d["event_id"] for docs in sent.values() for d in docs[2:]}
        replies = await read_topic_ids(
            bootstrap, settings.merged_topic, len(runs), key=lambda v: json.loads(v)["run_id"]
        )
        assert replies == set(runs)
        assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0
    finally:
        codes = [w.terminate() for w in workers]
    assert codes == [0, 0], "every member leaves cleanly on SIGTERM"


async def read_topic_ids(
    bootstrap: str, topic: str, distinct: int, key: Any = None, limit_s: float = 30
) -> set[str]:
    """The distinct ids on a topic (an event's ``event_id`` unless ``key`` says), read
    from the start until ``distinct`` are seen or ``limit_s`` passes; duplicates are
    allowed there (every reader de-duplicates)."""
    from aiokafka import AIOKafkaConsumer

    pick = key or (lambda v: json.loads(v)["event_id"])
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    seen: set[str] = set()
    try:
        deadline = asyncio.get_running_loop().time() + limit_s
        while len(seen) < distinct and asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            seen.update(pick(r.value) for rs in batch.values() for r in rs)
    finally:
        await consumer.stop()
    return seen
