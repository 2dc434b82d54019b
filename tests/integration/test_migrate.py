"""Replay to migrate (`alma replay --apply`) on the real services: runs rebuilt under new
reducers switch atomically for readers (PostgreSQL and the cache alike), an open run
takes events during its rebuild without a gap or a loss, the old states stay until
retention prunes them, and a run whose seqs would change is refused untouched."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

from alma_core.reducers import ReducerConfig
from alma_core.sdk.client import AlmaClient
from alma_core.settings import RetentionPolicy, Settings
from alma_core.storage import reducer_configs, retention
from alma_core.storage.cache_entries import cache_entries
from alma_core.storage.observer import Tally
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from alma_core.types import WorkflowContext
from tests.integration.harness import Worker, assert_replays_the_same, fetch
from tests.integration.test_replay import TENANT, WORKFLOW, make_run, replay_cli

SUMS = ReducerConfig(field_reducers={"n": "sum", "notes": "append"})
MAXES = ReducerConfig(field_reducers={"n": "max", "notes": "append"})


async def register(dsn: str, config: ReducerConfig) -> None:
    async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
        await reducer_configs.save(conn, TENANT, WORKFLOW, config)


async def hashes(dsn: str, table: str, run: str) -> dict[int, str]:
    rows = await fetch(
        dsn,
        f"SELECT seq, state_hash FROM {table} WHERE tenant_id = $1 AND run_id = $2",
        TENANT,
        run,
    )
    return {r["seq"]: r["state_hash"] for r in rows}


async def test_a_rebuild_switches_readers_atomically_while_its_run_takes_events(
    settings: Settings,
) -> None:
    dsn = settings.postgres_dsn or ""
    runs = [f"mg-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    await register(dsn, SUMS)
    answers: dict[str, list[list[tuple[int, str]]]] = {run: [] for run in runs}
    async with (
        Worker.start(settings, ("checkpointer", "joiner")),
        AlmaClient(settings) as client,
    ):
        for run in runs:
            await make_run(client, run)
        reader = await client.reader(TENANT)
        for run in runs:  # the cache holds every run's heads of projection 0
            await reader.branch_heads(run)
        await register(dsn, MAXES)

        stop = asyncio.Event()

        async def read(run: str) -> None:
            """Heads (cache and PostgreSQL), the latest and the history, in a loop."""
            while not stop.is_set():
                for cps in (
                    list((await reader.branch_heads(run)).values()),
                    [cp for cp in [await reader.latest(run)] if cp is not None],
                    await reader.history(run, limit=50),
                ):
                    answers[run].append([(cp.seq, cp.state_hash) for cp in cps])
                await asyncio.sleep(0)

        racer = runs[0]

        async def more() -> None:
            """The open run goes on during its rebuilds (appends: a checkpoint each)."""
            for i in range(12):
                ctx = WorkflowContext(TENANT, WORKFLOW, None, racer, f"more-{i}")
                done = await client.node_completed(ctx, updates={"notes": [f"more-{i}"]})
                await client.applied(ctx, done)

        readers = [asyncio.create_task(read(run)) for run in runs]
        adding = asyncio.create_task(more())
        migrations: list[dict[str, Any]] = []
        while not adding.done() or not migrations:
            code, doc = await asyncio.to_thread(
                replay_cli, settings, "--workflow", WORKFLOW, "--apply"
            )
            assert code == 0, doc
            migrations.append(doc)
        await adding
        code, last = await asyncio.to_thread(
            replay_cli, settings, "--workflow", WORKFLOW, "--apply"
        )
        assert (code, last["summary"]["rebuilt"], last["summary"]["current"]) == (0, 0, 3)
        stop.set()
        await asyncio.gather(*readers)

        # every run moved to projection 1 in the first pass: merge and what follows
        first = migrations[0]["summary"]
        assert (first["rebuilt"], first["refused"], first["skipped"]) == (3, 0, 0)
        for run in runs:
            old, new = (
                await hashes(dsn, "superseded_checkpoints", run),
                await hashes(dsn, "checkpoints", run),
            )
            assert sorted(old)[0] == 4  # the merge is the first state max changes
            assert all(old[seq] != new[seq] for seq in old)
            seen: set[str] = set()
            for answer in answers[run]:
                kinds = {
                    "old" if old.get(seq) == digest else "new"
                    for seq, digest in answer
                    if seq in old
                }
                assert len(kinds) <= 1, (run, answer)  # never a mix of two projections
                seen |= kinds
            assert seen == {"old", "new"}, (run, seen)  # the readers saw the switch

            # what readers get now is the new projection, from the cache too
            tally = Tally()
            ours = CheckpointReader(
                await client.read_pool(), reader.cache, tenant_id=TENANT, observer=tally
            )
            for _ in range(2):
                heads = await ours.branch_heads(run)
                assert {cp.seq: cp.state_hash for cp in heads.values()} == {
                    seq: new[seq] for seq in (cp.seq for cp in heads.values())
                }
            assert tally.counts["cache_hit"] >= 1

        # the open run: gapless seqs, every event of its race recorded
        seqs = sorted(await hashes(dsn, "checkpoints", racer))
        assert seqs == list(range(1, 6 + 12 + 1))
        recorded = await fetch(
            dsn,
            """SELECT node_id, checkpoint_seq FROM run_events
               WHERE tenant_id = $1 AND run_id = $2 AND node_id LIKE 'more-%'""",
            TENANT,
            racer,
        )
        assert len(recorded) == 12
        assert all(r["checkpoint_seq"] for r in recorded)
        assert await assert_replays_the_same(dsn, tenant=TENANT) >= len(runs)
        # the tenant's kept bytes (its storage quota's count) follow the rewritten sizes
        kept = await fetch(
            dsn,
            """SELECT (SELECT sum(bytes) FROM tenant_storage WHERE tenant_id = $1) AS counted,
                      (SELECT sum(size_bytes) FROM checkpoints WHERE tenant_id = $1) AS summed,
                      (SELECT count(*) FROM superseded_checkpoints s JOIN checkpoints c
                         USING (tenant_id, run_id, seq)
                       WHERE s.tenant_id = $1 AND s.size_bytes <> c.size_bytes) AS resized""",
            TENANT,
        )
        assert kept[0]["resized"] > 0  # some sizes changed: the count had to move
        assert kept[0]["counted"] == kept[0]["summed"]

        # a stale fill (a reader that read projection 0 before the switch) is never
        # served, and the next read replaces it
        run = runs[1]
        main = (await reader.branch_heads(run))[None]
        stale = await fetch(
            dsn,
            """SELECT state, state_hash FROM superseded_checkpoints
               WHERE tenant_id = $1 AND run_id = $2 AND seq = $3""",
            TENANT,
            run,
            main.seq,
        )
        old_main = replace(main, state=stale[0]["state"], state_hash=stale[0]["state_hash"])
        assert reader.cache is not None
        await reader.cache.put(cache_entries({None: old_main}))
        tally = Tally()
        ours = CheckpointReader(
            await client.read_pool(), reader.cache, tenant_id=TENANT, observer=tally
        )
        for _ in range(2):
            assert (await ours.branch_heads(run))[None].state_hash == main.state_hash
        assert (tally.counts["cache_miss"], tally.counts["cache_hit"]) == (1, 1)


async def test_runs_that_cannot_rebuild_are_left_as_they_are(settings: Settings) -> None:
    dsn = settings.postgres_dsn or ""
    folds, pruned = f"mf-{uuid.uuid4().hex[:6]}", f"mp-{uuid.uuid4().hex[:6]}"
    await register(dsn, SUMS)
    async with (
        Worker.start(settings, ("checkpointer", "joiner")),
        AlmaClient(settings) as client,
    ):
        at = WorkflowContext(TENANT, WORKFLOW, None, folds, "plan")
        await client.applied(at, await client.node_completed(at, state={"n": 5}))
        # under sum: 7, a checkpoint; under max: 5, the head already, none
        await client.applied(at, await client.node_completed(at, updates={"n": 2}))
        await make_run(client, pruned)
        done = WorkflowContext(TENANT, WORKFLOW, None, pruned, None)
        finished = await client.workflow_completed(
            done, success=True, duration_ms=1, node_count=5, nodes_succeeded=5, nodes_failed=0
        )
        await client.applied(done, finished)
    await register(dsn, MAXES)
    before = await hashes(dsn, "checkpoints", folds)

    code, doc = await asyncio.to_thread(replay_cli, settings, "--run", folds, "--apply")
    assert code == 1
    (verdict,) = doc["runs"]
    assert verdict["refused"]["seq"] == 2
    assert verdict["refused"]["what"] == "missing"
    assert verdict["projection"] == 0
    assert await hashes(dsn, "checkpoints", folds) == before
    assert await hashes(dsn, "superseded_checkpoints", folds) == {}

    # rebuilt, then retention: the old states go when they are old enough
    code, doc = await asyncio.to_thread(replay_cli, settings, "--run", pruned, "--apply")
    assert (code, doc["summary"]["rebuilt"]) == (0, 1)
    assert len(await hashes(dsn, "superseded_checkpoints", pruned)) == 3
    async with connect(dsn, max_size=1) as pool:
        result = await retention.prune(pool, RetentionPolicy(superseded_days=1e-9))
        assert result.superseded >= 3
        assert await hashes(dsn, "superseded_checkpoints", pruned) == {}
        assert len(await hashes(dsn, "checkpoints", pruned)) == 6
        # a run whose event log retention pruned cannot be replayed, so not rebuilt
        await retention.prune(pool, RetentionPolicy(events_days=1e-9))
    code, doc = await asyncio.to_thread(replay_cli, settings, "--run", pruned, "--apply")
    assert code == 0
    assert doc["runs"][0]["skipped"] == "retention pruned its events or checkpoints"
