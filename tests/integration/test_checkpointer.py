"""The checkpointer on the real broker, PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import asyncpg
import pytest

from alma_core.consumers import handler
from alma_core.settings import Settings
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.observer import Tally
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from tests.integration.harness import (
    Publisher,
    Worker,
    completed,
    count,
    event,
    fetch,
    read_topic,
    register_reducers,
    wait_for,
)


async def checkpoints_of(dsn: str, run_id: str) -> list[asyncpg.Record]:
    return await fetch(
        dsn,
        "SELECT seq, node_id, branch_id, parent_seq, kind, state, event_id FROM checkpoints "
        "WHERE run_id = $1 ORDER BY seq",
        run_id,
    )


async def test_sequential_runs_get_gapless_ordered_checkpoints(
    settings: Settings, worker: Worker
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    runs = [f"run-{i}" for i in range(6)]
    expected: dict[str, list[str]] = {r: [] for r in runs}
    async with Publisher(worker.settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for step in range(8):
            for run in runs:
                await pub.send(event("node.started", run, node=f"n{step}"))
                doc = completed(run, node=f"n{step}", updates={"step": step, f"k{step}": run})
                expected[run].append(doc["event_id"])
                await pub.send(doc)
        await pub.flush()

    async def all_in() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints") == 6 * 8

    await wait_for(all_in, what="48 checkpoints")
    for run in runs:
        rows = await checkpoints_of(dsn, run)
        assert [r["seq"] for r in rows] == list(range(1, 9))
        assert [r["event_id"] for r in rows] == expected[run]
        assert [r["parent_seq"] for r in rows] == [None, *range(1, 8)]
        final = rows[-1]["state"]
        assert final["step"] == 7
        assert {f"k{i}" for i in range(8)} <= set(final)
    assert await count(dsn, "SELECT count(*) FROM run_events") == 6 * 16
    assert await count(dsn, "SELECT count(*) FROM run_events WHERE effect = 'recorded'") == 48


async def test_duplicates_and_unchanged_states_have_no_second_effect(
    settings: Settings, worker: Worker
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    first = completed("dup-run", state={"a": 1})
    same_state = completed("dup-run", state={"a": 1})
    second = completed("dup-run", state={"a": 2})
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for doc in (first, first, same_state, second, first, second):
            await pub.send(doc)
        await pub.flush()

    async def settled() -> bool:
        return worker.value("alma_duplicates_total", {"consumer": "checkpointer"}) >= 3

    await wait_for(settled, what="three duplicates")
    rows = await checkpoints_of(dsn, "dup-run")
    assert [(r["seq"], r["state"]) for r in rows] == [(1, {"a": 1}), (2, {"a": 2})]
    effects = await fetch(dsn, "SELECT event_id, effect FROM run_events ORDER BY ordinal")
    assert [(r["event_id"], r["effect"]) for r in effects] == [
        (first["event_id"], "checkpointed"),
        (same_state["event_id"], "unchanged"),
        (second["event_id"], "checkpointed"),
    ]


async def test_branches_failures_and_handoffs(settings: Settings, worker: Worker) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    run = "branchy"
    docs = [
        completed(run, node="start", updates={"plan": "p"}),
        completed(run, node="a", branch="A", updates={"found": ["x"]}),
        completed(run, node="b", branch="B", updates={"found": ["y"]}),
        completed(run, node="a2", branch="A", updates={"more": 1}),
        event(
            "node.failed", run, node="b2", branch="B", error={"type": "Timeout", "message": "slow"}
        ),
        event("branch.join", run, node=None, join_id="j1", branch_ids=["A", "B"]),
        event(
            "workflow.completed",
            run,
            node=None,
            outcome="failure",
            duration_ms=10,
            node_count=5,
            nodes_succeeded=4,
            nodes_failed=1,
            error_message="slow",
        ),
    ]
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for doc in docs:
            await pub.send(doc)
        await pub.flush()

    async def done() -> bool:
        return await count(dsn, "SELECT count(*) FROM run_events") == len(docs)

    await wait_for(done, what="all events recorded")
    rows = await checkpoints_of(dsn, run)
    assert [(r["seq"], r["branch_id"], r["parent_seq"], r["kind"]) for r in rows] == [
        (1, None, None, "node"),
        (2, "A", 1, "node"),  # a branch's first checkpoint hangs off the main line
        (3, "B", 1, "node"),
        (4, "A", 2, "node"),
        (5, "B", 3, "failure"),
    ]
    assert rows[3]["state"] == {"found": ["x"], "more": 1}
    assert rows[4]["state"] == {"found": ["y"]}  # a failure keeps the branch's state
    status = await fetch(dsn, "SELECT status, completed_at FROM runs WHERE run_id = $1", run)
    assert status[0]["status"] == "failed"
    assert status[0]["completed_at"] is not None
    handed = await read_topic(settings.kafka_bootstrap or "", settings.sequenced_topic, 2)
    types = [json.loads(r.value)["type"] for r in handed]
    assert types == ["branch.join", "workflow.completed"]
    assert all(r.key == run.encode() for r in handed)
    assert {h[0] for h in handed[0].headers} >= {"alma.event_id", "alma.source.offset"}


async def test_reducers_registered_for_the_workflow_apply_to_updates(
    settings: Settings, worker: Worker
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    await register_reducers(dsn, "counting", {"log": "append", "n": "sum", "best": "max"})
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for i in range(10):
            await pub.send(
                completed("r", workflow="counting", updates={"log": [i], "n": i, "best": i % 7})
            )
        await pub.flush()

    async def ten() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints") == 10

    await wait_for(ten, what="ten checkpoints")
    rows = await checkpoints_of(dsn, "r")
    assert rows[-1]["state"] == {"log": list(range(10)), "n": 45, "best": 6}


async def test_bad_input_goes_to_the_dead_letters_and_the_partition_moves_on(
    settings: Settings, worker: Worker
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    await register_reducers(dsn, "broken", {"x": "no_such_reducer"})
    run = "victim"
    good: list[dict[str, Any]] = []
    poison: list[tuple[bytes | dict[str, Any], bytes, str]] = [
        (b"{oops", run.encode(), "malformed_json"),
        (
            json.dumps({**completed(run, state={}), "type": "node.paused"}).encode(),
            run.encode(),
            "unknown_type",
        ),
        (completed(run, state={"x": 1}, expected_seq=99), run.encode(), "stale_expected_seq"),
        (completed(run, state={"blob": "x" * 70_000}), run.encode(), "state_too_large"),
        # Small alone, too large once folded into the run's state:
        (completed(run, updates={"grow2": "y" * 40_000}), run.encode(), "state_too_large"),
        (completed("other", workflow="broken", updates={"x": 1}), b"other", "unknown_reducer"),
        (completed(run, state={"a": "\u0000"}), run.encode(), "schema_violation"),
        (
            json.dumps(completed(run, state={"a": "X"})).replace('"X"', '"\\ud800"').encode(),
            run.encode(),
            "schema_violation",
        ),
    ]
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        # The run's first event exists so the expected_seq and the size checks have a run.
        first = completed(run, updates={"grow": "z" * 30_000})
        good.append(first)
        await pub.send(first)
        for i, (value, key, _) in enumerate(poison):
            await pub.send(value, key=key)
            doc = completed(run, updates={"i": i})
            good.append(doc)
            await pub.send(doc)
        await pub.flush()

    async def all_good() -> bool:
        return await count(dsn, "SELECT count(*) FROM run_events") == len(good)

    await wait_for(all_good, what="every good event")

    async def all_dead() -> bool:
        return await count(dsn, "SELECT count(*) FROM dead_letters") == len(poison)

    await wait_for(all_dead, what="every dead letter")
    rows = await checkpoints_of(dsn, run)
    assert [r["event_id"] for r in rows] == [g["event_id"] for g in good]
    letters = await fetch(
        dsn, "SELECT reason, source_offset FROM dead_letters ORDER BY source_offset"
    )
    assert sorted(r["reason"] for r in letters) == sorted(p[2] for p in poison)
    dlq = await read_topic(settings.kafka_bootstrap or "", settings.dlq_topic, len(poison))
    reasons = sorted(dict(r.headers)["alma.reason"].decode() for r in dlq)
    assert reasons == sorted(p[2] for p in poison)
    for record in dlq:
        headers = dict(record.headers)
        assert headers["alma.source.topic"].decode() == settings.lifecycle_topic
        assert int(headers["alma.source.offset"].decode()) >= 0
    assert (
        worker.value(
            "alma_dead_letters_total", {"consumer": "checkpointer", "reason": "state_too_large"}
        )
        == 2
    )


async def test_cache_matches_postgres_and_reads_are_tenant_scoped(
    settings: Settings, worker: Worker
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    assert settings.redis_url
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for i in range(5):
            await pub.send(completed("cached", updates={"i": i, f"key{i}": True}))
        await pub.send(completed("cached", branch="side", updates={"side": 1}))
        await pub.send(completed("theirs", tenant="globex", state={"secret": 1}))
        await pub.flush()

    async def seven() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints") == 7

    await wait_for(seven, what="seven checkpoints")
    async with (
        connect(dsn) as pool,
        RedisCheckpointCache.for_settings(settings) as cache,
    ):

        async def cached() -> bool:  # written right after the commit (read raw: no fill)
            seqs = [
                doc["seq"] if doc else None
                for doc, _ in [
                    await cache.get("acme", "cached", f) for f in ("latest", "@", "b:side")
                ]
            ]
            return seqs == [6, 5, 6]

        await wait_for(cached, what="the writer's cache entries")
        tally = Tally()
        reader = CheckpointReader(pool, cache, tenant_id="acme", observer=tally)
        latest = await reader.latest("cached")
        assert latest is not None
        assert (latest.seq, latest.branch_id) == (6, "side")
        heads = await reader.branch_heads("cached")
        assert {b: cp.seq for b, cp in heads.items()} == {None: 5, "side": 6}
        assert dict(tally.counts) == {"cache_hit": 2}  # latest and the heads, from the cache
        uncached = CheckpointReader(pool, None, tenant_id="acme")
        assert await uncached.latest("cached") == latest
        assert await uncached.branch_heads("cached") == heads
        main = await reader.main_head("cached")
        assert main is not None
        assert "key4" in main.state
        assert "side" not in main.state
        history = await reader.history("cached", limit=3)
        assert [cp.seq for cp in history] == [6, 5, 4]
        assert [cp.seq for cp in await reader.history("cached", before_seq=3)] == [2, 1]
        got = await reader.get("cached", 2)
        assert got is not None
        assert got.state == {"i": 1, "key0": True, "key1": True}
        # Another tenant's run is not found, from the cache or from PostgreSQL.
        assert await reader.latest("theirs") is None
        assert await uncached.latest("theirs") is None
        assert await reader.get("theirs", 1) is None
        assert await reader.history("theirs") == []
        assert await CheckpointReader(pool, cache, tenant_id="globex").latest("theirs") is not None


async def test_concurrent_updates_from_parallel_producers_lose_nothing(
    settings: Settings, worker: Worker
) -> None:
    """The memory SDK seed's race (read-modify-write from several writers) cannot
    happen: writers send updates, the run's single writer folds them with reducers."""
    dsn = settings.postgres_dsn
    assert dsn
    await register_reducers(dsn, "shared", {"actions": "append", "count": "sum"})
    writers, each = 4, 40

    async def writer(w: int) -> None:
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            for i in range(each):
                await pub.send(
                    completed(
                        "shared-run",
                        workflow="shared",
                        node=f"w{w}",
                        updates={"actions": [f"w{w}-{i}"], "count": 1},
                    )
                )
                if i % 10 == 0:
                    await pub.flush()
            await pub.flush()

    await asyncio.gather(*(writer(w) for w in range(writers)))

    async def all_in() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints") == writers * each

    await wait_for(all_in, what="every update")
    final = (await checkpoints_of(dsn, "shared-run"))[-1]["state"]
    assert final["count"] == writers * each
    assert sorted(final["actions"]) == sorted(
        f"w{w}-{i}" for w in range(writers) for i in range(each)
    )
    for w in range(writers):  # each writer's updates land in the order it sent them
        mine = [a for a in final["actions"] if a.startswith(f"w{w}-")]
        assert mine == [f"w{w}-{i}" for i in range(each)]


async def test_concurrent_transactions_keep_order_and_lose_nothing(
    settings: Settings, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four transactions at once per polled batch (ALMA_CHECKPOINT_CONCURRENCY), each on
    its own partitions. Most runs are keyed by their id (one partition each: order is
    the partition's); one run's updates come without a key (the contract allows it),
    placed in partitions 0 and 1 in turn: the partitions that share it must stay in
    one transaction (two could both create the run: gapless seqs, no update lost, no
    batch failing)."""
    dsn = settings.postgres_dsn
    assert dsn
    s = settings.model_copy(update={"checkpoint_concurrency": 4})
    monkeypatch.setattr(handler, "SPLIT_BYTES", 1)  # small records: split every batch
    await register_reducers(dsn, "spread", {"count": "sum", "seen": "append"})
    runs, steps, spread = [f"c-{i}" for i in range(8)], 12, 48
    async with Publisher(s.kafka_bootstrap or "", s.lifecycle_topic) as pub:
        for step in range(steps):  # all published first: polls find every partition busy
            for run in runs:
                await pub.send(completed(run, node=f"n{step}", updates={"step": step}))
            for i in range(spread // steps):
                n = step * (spread // steps) + i
                doc = completed("spread", workflow="spread", updates={"count": 1, "seen": [n]})
                await pub.producer.send(
                    s.lifecycle_topic, json.dumps(doc).encode(), partition=n % 2
                )
        await pub.flush()

    async def all_in() -> bool:
        total = await count(dsn, "SELECT count(*) FROM checkpoints")
        return total == len(runs) * steps + spread

    with caplog.at_level(logging.WARNING, logger="alma.consumers"):
        async with Worker.start(s) as worker:
            await wait_for(all_in, what="every checkpoint")
            batches = worker.value("alma_batch_seconds_count", {"consumer": "checkpointer"})
            transactions = worker.value(
                "alma_checkpoint_write_seconds_count", {"consumer": "checkpointer"}
            )
    assert transactions > batches, "no batch ran more than one transaction"
    for run in runs:
        rows = await checkpoints_of(dsn, run)
        assert [r["seq"] for r in rows] == list(range(1, steps + 1))
        assert [r["state"]["step"] for r in rows] == list(range(steps))
    rows = await checkpoints_of(dsn, "spread")
    assert [r["seq"] for r in rows] == list(range(1, spread + 1))
    assert rows[-1]["state"]["count"] == spread
    assert sorted(rows[-1]["state"]["seen"]) == list(range(spread))
    assert await count(dsn, "SELECT count(*) FROM run_events WHERE effect = 'checkpointed'") == (
        len(runs) * steps + spread
    )
    assert not [r for r in caplog.records if getattr(r, "action", "") == "isolate_batch"]


async def test_a_paced_worker_applies_what_comes_after_quiet_spells(settings: Settings) -> None:
    """With the embedded broker's idle pace (a long fetch wait once a consumer had no
    record for 2 s), what comes after a quiet spell and the burst after it are applied,
    each once and in order: the pace changes when fetches are answered, nothing else."""
    dsn = settings.postgres_dsn or ""
    paced = settings.model_copy(update={"fetch_idle_wait_ms": 500})
    async with (
        Worker.start(paced),
        Publisher(paced.kafka_bootstrap or "", paced.lifecycle_topic) as pub,
    ):
        sent = 0
        for spell in range(3):
            await asyncio.sleep(2.5)  # quiet: the consumer goes to the long wait
            for _ in range(1 + 10 * spell):  # then one event, or a burst
                await pub.send(completed("paced", node=f"n{sent}", updates={"i": sent}))
                sent += 1
            await pub.flush()
            total = sent

            async def applied(total: int = total) -> bool:
                return await count(dsn, "SELECT count(*) FROM checkpoints") == total

            await wait_for(applied, what=f"{total} checkpoints after quiet spell {spell}")
    rows = await checkpoints_of(dsn, "paced")
    assert [r["seq"] for r in rows] == list(range(1, sent + 1))
    assert [r["state"]["i"] for r in rows] == list(range(sent))


async def test_a_worker_idle_in_a_long_poll_stops_at_once(settings: Settings) -> None:
    """Idle, a consumer polls as long as its idle fetch wait (it does not wake five times
    a second for nothing); a stop ends such a poll rather than waiting it out."""
    dsn = settings.postgres_dsn or ""
    paced = settings.model_copy(update={"fetch_idle_wait_ms": 90_000})
    async with Publisher(paced.kafka_bootstrap or "", paced.lifecycle_topic) as pub:
        async with Worker.start(paced) as worker:
            await pub.send(completed("long-poll", node="n0", updates={"i": 0}))
            await pub.flush()

            async def applied() -> bool:
                return await count(dsn, "SELECT count(*) FROM checkpoints") == 1

            await wait_for(applied, what="the checkpoint before the quiet spell")
            await asyncio.sleep(4)  # quiet for 2 s: the next polls last 90 s
            polls = worker.value("alma_last_poll_timestamp_seconds", {"consumer": "checkpointer"})
            await asyncio.sleep(1.5)
            assert polls == worker.value(
                "alma_last_poll_timestamp_seconds", {"consumer": "checkpointer"}
            )  # in one long poll: no poll ended meanwhile
            stopping = asyncio.get_running_loop().time()
        stopped_in = asyncio.get_running_loop().time() - stopping
    assert stopped_in < 30, f"the stop waited {stopped_in:.0f} s for the 90 s poll"
