"""Chaos: checkpointer processes killed with SIGKILL at random points while several
producers publish (with duplicates); members joining and leaving mid-stream.
Afterwards the invariants must hold: one checkpoint per accepted event, seq
1..n per run in publish order, and the cache equal to PostgreSQL."""

from __future__ import annotations

import asyncio
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
    completed,
    count,
    fetch,
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
                doc = completed(run, node=f"n{step}", updates={"step": step, "by": run})
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
    workers = [WorkerProcess(settings, tmp_path / f"worker-{i}.log").start() for i in range(3)]
    published: dict[str, list[dict[str, Any]]] = {}
    resend: list[dict[str, Any]] = []
    producers_done = asyncio.Event()
    runs = [f"run-{i:02d}" for i in range(24)]
    try:
        producers = asyncio.gather(
            *(produce(settings, runs[i::3], 25, published, resend, rng) for i in range(3))
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
        # One more event per run with the members stable (every restarted member up,
        # its start-up epoch bump done): the cache must then equal PostgreSQL.
        for w in workers:
            await w.wait_started()
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            for run in runs:
                doc = completed(run, updates={"final": True})
                published[run].append(doc)
                await pub.send(doc)
            await pub.flush()

        async def final_in() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == total + len(runs)

        await wait_for(final_in, limit_s=60, what="the final checkpoints")
        await asyncio.sleep(0.5)
        await assert_exactly_once(dsn, published)
        assert await assert_cache_matches(settings, runs, require_all=True) == len(runs)
        assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0
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
        await asyncio.sleep(3.0)
        assert joiner.terminate() == 0  # rebalance: leave, draining its batch
        second = WorkerProcess(settings, tmp_path / "second.log").start()
        await producer
        total = sum(len(v) for v in published.values())

        async def all_in() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") >= total

        await wait_for(all_in, limit_s=90, what=f"{total} checkpoints")
        assert second.terminate() == 0
    await assert_exactly_once(dsn, published)


async def test_joiner_killed_mid_stream_every_join_answered_once(
    settings: Settings, tmp_path: Path
) -> None:
    """The joiner SIGKILLed while joins are in flight (some between the merged
    checkpoint and the reply): orchestrators retrying with the same join_id all get
    their answer, and each join has exactly one merged checkpoint."""
    from alma_core import errors
    from alma_core.sdk.client import AlmaClient
    from alma_core.types import WorkflowContext

    dsn = settings.postgres_dsn
    assert dsn
    rng = random.Random(7)
    runs = [f"j{i}" for i in range(10)]
    async with (
        Worker.start(settings),
        Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub,
    ):
        for run in runs:
            for b in ("x", "y"):
                await pub.send(completed(run, branch=b, updates={"log": [b]}))
        await pub.flush()
        joiner = WorkerProcess(settings, tmp_path / "joiner.log", consumers="join").start()

        async def ask(client: AlmaClient, run: str, k: int) -> Any:
            ctx = WorkflowContext(tenant_id="acme", workflow_id="wf", run_id=run)
            for _ in range(8):
                try:
                    return await client.merge(ctx, branch_ids=["x", "y"], join_id=f"{run}-{k}",
                                              reducers={"log": "append"}, timeout=5)  # fmt: skip
                except errors.MergeTimeout:
                    continue  # the same join_id again: safe
            raise AssertionError(f"join {run}-{k} never answered")

        async with AlmaClient(settings) as client:
            asking = asyncio.gather(*(ask(client, run, k) for run in runs for k in range(3)))
            for _ in range(2):
                await asyncio.sleep(rng.uniform(0.3, 1.0))
                joiner.kill()
                await asyncio.sleep(0.3)
                joiner.start()
            replies = await asyncio.wait_for(asyncio.shield(asking), 120)
        assert joiner.terminate() == 0
    assert all(r.status == "ok" for r in replies)
    assert len({(r.run_id, r.join_id) for r in replies}) == 30
    rows = await fetch(
        dsn, "SELECT metadata->>'join_id' AS j, count(*) AS n FROM checkpoints "
        "WHERE kind = 'merge' GROUP BY 1"
    )  # fmt: skip
    assert len(rows) == 30
    assert all(r["n"] == 1 for r in rows)
    for run in runs:  # three joins of one run: seqs follow each other, no gap
        seqs = await fetch(dsn, "SELECT seq FROM checkpoints WHERE run_id = $1 ORDER BY seq", run)
        assert [r["seq"] for r in seqs] == list(range(1, 6))
