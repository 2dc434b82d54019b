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
from tests.integration.conftest import PrivateStack
from tests.integration.harness import (
    Publisher,
    Worker,
    WorkerProcess,
    assert_cache_matches,
    assert_exactly_once,
    assert_reads_fresh,
    assert_replays_the_same,
    completed,
    count,
    fetch,
    finished,
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
                    finished(run, 2, f"chaos run {run}"),
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
        assert await assert_replays_the_same(dsn) == len(runs)  # `alma replay`: no difference
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


# --- faults inside faults ---------------------------------------------------------------

POISON = [
    b"{not json",  # malformed_json
    json.dumps({"type": "node.exploded"}).encode(),  # unknown_type
    b"[1, 2, 3]",  # not_an_object
]


def compound_run(run: str, steps: int) -> list[dict[str, Any]]:
    """A run as an orchestrator publishes it without waiting: ``steps`` main-line nodes,
    two branches, their join, the completion. Each node adds 1 to ``count`` and its
    name to ``history`` (reducers sum and append): a node applied twice or lost shows."""
    from tests.integration.harness import event

    docs = [
        completed(run, node=f"n{i}", updates={"count": 1, "history": [f"n{i}"]})
        for i in range(steps)
    ]
    docs += [
        completed(run, node=b, branch=b, updates={"count": 1, "history": [b]}) for b in ("a", "b")
    ]
    docs.append(
        event(
            "branch.join",
            run,
            node="join",
            join_id=f"{run}-join",
            branch_ids=["a", "b"],
            reducers={"count": "sum", "history": "append"},
        )
    )
    docs.append(finished(run, steps + 2, f"compound chaos {run}"))
    return docs


async def test_compound_faults_postgres_down_while_members_die(
    private_stack: PrivateStack, tmp_path: Path
) -> None:
    """PostgreSQL (outside the workers, as in production) is SIGKILLed and left down
    for 15 s while events keep coming; meanwhile a checkpointer member is SIGKILLed
    every 1–2 s (the last one alive sees the group rebalance inside its storage retry;
    the ones restarted wait for PostgreSQL and are killed in turn) and the
    joiner/learner member once. Afterwards: every run's seqs are 1..n in event order,
    every counter exact, one merge, join reply and outcome per run, every poison record
    in the dead letters, the cache equal to PostgreSQL, and no offset was ever counted
    as a hole in the log."""
    settings = private_stack.settings
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    pg = private_stack.postgres
    await register_reducers(dsn, "wf", {"count": "sum", "history": "append"})
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    runs, steps = [f"cx-{i:02d}" for i in range(12)], 4
    sent = {run: compound_run(run, steps) for run in runs}
    checkpointers = [
        WorkerProcess(settings, tmp_path / f"cp-{i}.log", consumers="checkpointer")
        for i in range(4)
    ]
    others = WorkerProcess(settings, tmp_path / "jl.log", consumers="joiner,learner")
    members = [*checkpointers, others]
    kills = 0

    async def publish(pub: Publisher, until: float) -> int:
        """Every run's events in order, runs interleaved, spread until ``until``; a
        tenth sent twice; the poison between them."""
        queue = [sent[run][i] for i in range(steps + 4) for run in runs]
        poison_at = {len(queue) * (k + 1) // (len(POISON) + 1): p for k, p in enumerate(POISON)}
        pause = max(0.0, until - asyncio.get_running_loop().time()) / len(queue)
        records = 0
        for n, doc in enumerate(queue):
            await pub.send(doc)
            records += 1
            if rng.random() < 0.1:
                await pub.send(doc)  # a producer's retry: same event_id, another offset
                records += 1
            if n in poison_at:
                await pub.send(poison_at[n], key="poison")
                records += 1
            await pub.flush()
            await asyncio.sleep(pause)
        return records

    try:
        for m in members:
            m.start()
        for m in members:
            await m.wait_started(limit_s=120)
        loop = asyncio.get_running_loop()
        async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
            producing = asyncio.create_task(publish(pub, loop.time() + 25))
            await asyncio.sleep(4)
            port = pg.port
            pg.kill()
            outage_started = loop.time()
            others_killed, live = False, set(checkpointers)  # members of the group
            while loop.time() - outage_started < 15:
                await asyncio.sleep(rng.uniform(1.0, 2.0))
                # a live member while another is left to see the rebalance inside its
                # retry; then the ones restarted, still waiting for PostgreSQL
                pick = [m for m in checkpointers if (m in live) == (len(live) > 1)]
                victim = rng.choice(pick)
                victim.kill()
                victim.start()
                live.discard(victim)
                kills += 1
                if not others_killed and loop.time() - outage_started > 6:
                    others.kill()
                    others.start()
                    others_killed = True
                    kills += 1
            await pg.start(port=port)
            outage_s = loop.time() - outage_started
            records = await producing

        async def settled() -> bool:
            merges = await count(dsn, "SELECT count(*) FROM checkpoints WHERE kind = 'merge'")
            outcomes = await count(dsn, "SELECT count(*) FROM workflow_outcomes")
            letters = await count(dsn, "SELECT count(*) FROM dead_letters")
            return (merges, outcomes, letters) == (len(runs), len(runs), len(POISON))

        await wait_for(settled, limit_s=90, what="every merge, outcome and dead letter")
        # the cache against PostgreSQL first: nothing else is written now
        await assert_cache_matches(settings, runs, require_all=False)
        await assert_reads_fresh(settings, runs)
        assert await assert_replays_the_same(dsn) == len(runs)  # `alma replay`: no difference
        for run, docs in sent.items():
            rows = await fetch(
                dsn,
                "SELECT seq, kind, event_id, state FROM checkpoints WHERE run_id = $1 ORDER BY seq",
                run,
            )
            assert [r["event_id"] for r in rows] == [d["event_id"] for d in docs[:-1]], run
            assert [r["seq"] for r in rows] == list(range(1, steps + 4)), run
            merged = rows[-1]
            assert merged["kind"] == "merge", run
            history = [f"n{i}" for i in range(steps)] + ["a", "b"]
            assert merged["state"] == {"count": steps + 2, "history": history}, run
        joins = await fetch(dsn, "SELECT run_id, status, checkpoint_seq FROM joins")
        assert sorted((j["run_id"], j["status"], j["checkpoint_seq"]) for j in joins) == [
            (run, "ok", steps + 3) for run in runs
        ]
        outcomes = await fetch(dsn, "SELECT run_id, event_id FROM workflow_outcomes")
        assert sorted((o["run_id"], o["event_id"]) for o in outcomes) == sorted(
            (run, docs[-1]["event_id"]) for run, docs in sent.items()
        )
        letters = await fetch(dsn, "SELECT reason, value FROM dead_letters ORDER BY value")
        assert sorted(bytes(r["value"]) for r in letters) == sorted(POISON)
        events = await count(dsn, "SELECT count(*) FROM run_events")
        assert events == sum(len(docs) for docs in sent.values())
        replies = await read_topic_ids(
            bootstrap, settings.merged_topic, len(runs), key=lambda v: json.loads(v)["run_id"]
        )
        assert replies == set(runs)
        dlq = await read_topic_ids(bootstrap, settings.dlq_topic, len(POISON), key=bytes)
        assert dlq == set(POISON)
        logs = {m.log_path.name: m.log_path.read_text() for m in members}
        assert [name for name, text in logs.items() if '"log_hole"' in text] == [], (
            "an offset was counted as a hole in the log"
        )
        # the faults did overlap: a member saw the group rebalance inside its retry
        assert any('"retry_rebalanced"' in text for text in logs.values())
        print(
            f"compound faults: seed {seed}, {len(runs)} runs, {records} records "
            f"({sum(len(d) for d in sent.values())} events, {len(POISON)} poison), "
            f"{kills} kills, PostgreSQL down {outage_s:.1f} s, problems 0"
        )
    finally:
        codes = [m.terminate() for m in members]
    assert all(code == 0 for code in codes), codes
