"""Reads are never older than PostgreSQL (issue 21, items 3 and 4): whatever the cache
holds, a reader returns the checkpoints PostgreSQL has committed. The cache is a copy
of immutable checkpoints keyed by their seq; PostgreSQL's branch heads say which seqs
are current, so an entry a writer never replaced is never served.

Each test makes the cache older than PostgreSQL in a way production does: a member
killed between its commit and its cache write, a writer in another process whose
cache write lands after the reader asked, retention deleting a run's checkpoints.
"""

from __future__ import annotations

import json
from typing import Any

from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerRegistry
from alma_core.schemas.decoder import decode
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.run_state import RunState
from alma_core.settings import RetentionPolicy, Settings
from alma_core.storage import retention
from alma_core.storage.batches import Incoming
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.checkpoints import PostgresCheckpointStore, StoreConfig
from alma_core.storage.observer import Tally
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from alma_core.types import WorkflowContext
from tests.integration.harness import Publisher, Worker, WorkerProcess, completed, count, wait_for


def as_records(docs: list[dict[str, Any]], start: int) -> list[Incoming]:
    out = []
    for i, doc in enumerate(docs):
        raw = json.dumps(doc).encode()
        key = doc["run_id"].encode()
        out.append(Incoming("elsewhere", 0, start + i, key, raw, decode(raw, key=key)))
    return out


async def test_a_commit_whose_cache_write_never_came_is_read_from_postgres(
    settings: Settings,
) -> None:
    """A member committed seq 4 and 5 and died before writing the cache: the cache still
    holds seq 3 as the run's latest and its main line, PostgreSQL has 5."""
    dsn = settings.postgres_dsn or ""
    async with Worker.start(settings):
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            for i in range(3):
                await pub.send(completed("killed", state={"n": i}))
            await pub.flush()

        async def three() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

        await wait_for(three, what="three checkpoints, cached")
    async with connect(dsn) as pool:  # what the killed member committed, and no more
        store = PostgresCheckpointStore(
            pool, StoreConfig("other-group", "checkpointer", "x", "y", 10**6), ReducerRegistry()
        )
        docs = [completed("killed", state={"n": 3}), completed("killed", state={"n": 4})]
        await store.transact("c", {("elsewhere", 0): as_records(docs, 0)}, TenantLimits())
        async with RedisCheckpointCache.for_settings(settings) as cache:
            cached, _ = await cache.get("acme", "killed", "latest")
            assert cached is not None
            assert cached["seq"] == 3  # the cache is behind
            tally = Tally()
            reader = CheckpointReader(pool, cache, tenant_id="acme", observer=tally)
            latest = await reader.latest("killed")
            assert latest is not None
            assert (latest.seq, latest.state) == (5, {"n": 4})
            # the stale entry was not served; the current one came from PostgreSQL
            assert dict(tally.counts) == {"cache_miss": 1}
            main = await reader.main_head("killed")  # now from the cache, at seq 5
            assert main is not None
            assert main.seq == 5
            heads = await reader.branch_heads("killed")
            assert {b: cp.seq for b, cp in heads.items()} == {None: 5}
            assert "n" in main.state
            assert dict(tally.counts) == {"cache_miss": 1, "cache_hit": 2}


async def test_run_state_reads_its_own_writes_from_another_process(
    settings: Settings, tmp_path: Any
) -> None:
    """The checkpointer in its own process: after set() returns (the write is durable),
    get() and seq never show an older state, however the cache write races."""
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await worker.wait_started()
        async with AlmaClient(settings) as client:
            ctx = WorkflowContext("acme", "ryw", None, "ryw-run")
            state = RunState(client, ctx, counters=("n",))
            for i in range(25):
                seq = await state.set("value", i)
                assert await state.get("value") == i
                assert state.seq == seq  # the read saw the write, not an older head
    finally:
        assert worker.terminate() == 0


async def test_checkpoints_retention_deleted_are_not_served(settings: Settings) -> None:
    dsn = settings.postgres_dsn or ""
    async with Worker.start(settings):
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            await pub.send(completed("old", state={"n": 1}))
            await pub.send(
                {
                    **completed("old", node=None),
                    "type": "workflow.completed",
                    "payload": {
                        "outcome": "success",
                        "duration_ms": 1,
                        "node_count": 1,
                        "nodes_succeeded": 1,
                        "nodes_failed": 0,
                    },
                }
            )
            await pub.flush()

        async def completed_run() -> bool:
            return await count(dsn, "SELECT count(*) FROM runs WHERE status = 'succeeded'") == 1

        await wait_for(completed_run, what="the completed run")
    async with connect(dsn) as pool:
        await pool.execute("UPDATE runs SET completed_at = now() - interval '30 days'")
        pruned = await retention.prune(
            pool, RetentionPolicy(checkpoints_days=7), batch_runs=10, max_batches=1
        )
        assert pruned.checkpoints == 1
        async with RedisCheckpointCache.for_settings(settings) as cache:
            cached, _ = await cache.get("acme", "old", "latest")
            assert cached is not None  # still in Redis
            reader = CheckpointReader(pool, cache, tenant_id="acme")
            assert await reader.latest("old") is None
            assert await reader.branch_heads("old") == {}
