"""The store's exactly-once mechanism, driven directly: redelivery after a crash
between the PostgreSQL commit and the Kafka commit, a zombie member writing
late, a gap in what was read, a hole in the log, and a batch read without locks
whose runs or offsets change before its write."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.schemas.decoder import decode
from alma_core.storage import locked, postgres, reducer_configs
from alma_core.storage.batches import Incoming
from alma_core.storage.checkpoints import PostgresCheckpointStore, StoreConfig
from tests.integration.harness import completed, count, fetch, wait_for

TOPIC = "lifecycle"


def connect(database: str, *, max_size: int = 8) -> Any:
    """A pool as a worker's: each statement planned once (ALMA_PG_GENERIC_PLANS)."""
    return postgres.connect(database, max_size=max_size, generic_plans=True)


def records(
    docs: list[dict[str, Any]], start: int = 0, partition: int = 0, read_from: int | None = None
) -> list[Incoming]:
    """Records at consecutive offsets from ``start``; the first read from ``read_from``
    (the consumer's position: an earlier offset when the log has nothing between)."""
    out = []
    for i, doc in enumerate(docs):
        raw = json.dumps(doc).encode()
        key = doc["run_id"].encode()
        position = read_from if i == 0 else start + i
        out.append(
            Incoming(TOPIC, partition, start + i, key, raw, decode(raw, key=key), (), position)
        )
    return out


def store_for(pool: Any, *, unlocked: bool = True, memory: int = 0) -> PostgresCheckpointStore:
    config = StoreConfig(
        "alma-checkpointer",
        "checkpointer",
        "sequenced",
        "dlq",
        1_000_000,
        unlocked_reads=unlocked,
        memory_bytes=memory,
    )
    return PostgresCheckpointStore(pool, config, ReducerRegistry())


async def test_redelivered_batch_has_no_second_effect(database: str) -> None:
    docs = [completed("r", updates={"i": i}) for i in range(5)]
    async with connect(database) as pool:
        assert await pool.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
        store = store_for(pool)
        first = await store.transact("cluster-a", {(TOPIC, 0): records(docs)}, TenantLimits())
        assert first.progress.next_offsets == {(TOPIC, 0): 5}
        # The worker died before committing to Kafka: the same records come again,
        # and with them two new ones.
        more = [*docs, completed("r", updates={"i": 5}), completed("r", updates={"i": 6})]
        again = await store.transact("cluster-a", {(TOPIC, 0): records(more)}, TenantLimits())
        assert again.progress.already_applied == 5
        assert again.effects is not None
        assert len(again.effects.checkpoints) == 2
        assert await store.stored_offsets("cluster-a", [(TOPIC, 0)]) == {(TOPIC, 0): 7}
    rows = await fetch(database, "SELECT seq FROM checkpoints WHERE run_id = 'r' ORDER BY seq")
    assert [r["seq"] for r in rows] == list(range(1, 8))


async def test_zombie_and_new_owner_apply_once(database: str) -> None:
    docs = [completed(f"run-{i % 3}", updates={"i": i}) for i in range(60)]
    async with connect(database, max_size=4) as pool:
        zombie, owner = store_for(pool), store_for(pool)
        # Both believe they own partition 0; they race on overlapping batches.
        results = await asyncio.gather(
            zombie.transact("c", {(TOPIC, 0): records(docs[:40])}, TenantLimits()),
            owner.transact("c", {(TOPIC, 0): records(docs)}, TenantLimits()),
        )
    assert sum(len(r.effects.checkpoints) for r in results if r.effects) == 60
    assert await count(database, "SELECT count(*) FROM checkpoints") == 60
    for run in ("run-0", "run-1", "run-2"):
        rows = await fetch(
            database, "SELECT seq, state FROM checkpoints WHERE run_id = $1 ORDER BY seq", run
        )
        assert [r["seq"] for r in rows] == list(range(1, 21))
        assert [r["state"]["i"] for r in rows] == [i for i in range(60) if f"run-{i % 3}" == run]


async def test_republished_event_id_is_applied_once(database: str) -> None:
    doc = completed("r", state={"a": 1})
    async with connect(database) as pool:
        store = store_for(pool)
        await store.transact("c", {(TOPIC, 0): records([doc])}, TenantLimits())
        # The producer retried: the same event at a new offset, on another partition.
        result = await store.transact(
            "c", {(TOPIC, 1): records([doc], partition=1)}, TenantLimits()
        )
    assert result.effects is not None
    assert result.effects.duplicates == 1
    assert await count(database, "SELECT count(*) FROM checkpoints") == 1


async def test_a_gap_sends_the_partition_back(database: str) -> None:
    async with connect(database) as pool:
        store = store_for(pool)
        await store.transact(
            "c", {(TOPIC, 0): records([completed("r", state={"a": 1})])}, TenantLimits()
        )
        later = await store.transact(
            "c", {(TOPIC, 0): records([completed("r", state={"a": 2})], 5)}, TenantLimits()
        )
    assert later.progress.seeks == {(TOPIC, 0): 1}
    assert later.effects is None  # nothing applied: the partition goes back


async def test_a_hole_the_consumer_read_across_is_moved_past(database: str) -> None:
    """The consumer read from offset 1 and the log's next record was at 3 (a commit
    marker, removed records): nothing exists to go back for."""
    async with connect(database) as pool:
        store = store_for(pool)
        await store.transact(
            "c", {(TOPIC, 0): records([completed("r", state={"a": 1})])}, TenantLimits()
        )
        docs = [completed("r", state={"a": 2}), completed("r", state={"a": 3})]
        later = await store.transact(
            "c", {(TOPIC, 0): records(docs, 3, read_from=1)}, TenantLimits()
        )
        assert later.progress.holes == {(TOPIC, 0): (1, 3)}
        assert later.progress.seeks == {}
        assert later.effects is not None
        assert [c.seq for c in later.effects.checkpoints] == [2, 3]
        assert await store.stored_offsets("c", [(TOPIC, 0)]) == {(TOPIC, 0): 5}
        # read from beyond the stored offset: not a hole, a gap to go back for
        gap = await store.transact(
            "c",
            {(TOPIC, 0): records([completed("r", state={"a": 4})], 9, read_from=7)},
            TenantLimits(),
        )
        assert gap.progress.seeks == {(TOPIC, 0): 5}
        assert gap.progress.holes == {}


async def test_offsets_of_another_broker_cluster_are_kept_apart(database: str) -> None:
    async with connect(database) as pool:
        store = store_for(pool)
        await store.transact(
            "old-cluster", {(TOPIC, 0): records([completed("r", state={"a": 1})])}, TenantLimits()
        )
        fresh = await store.transact(
            "new-cluster", {(TOPIC, 0): records([completed("r", state={"a": 2})])}, TenantLimits()
        )
        assert fresh.effects is not None
        assert len(fresh.effects.checkpoints) == 1
        assert await store.stored_offsets("new-cluster", [(TOPIC, 0)]) == {(TOPIC, 0): 1}


async def test_dead_letters_of_another_broker_cluster_are_kept_apart(database: str) -> None:
    """The embedded broker starts empty under a new cluster id: its records reuse the
    old log's offsets. A dead letter at an offset the old log had must still be kept."""
    async with connect(database) as pool:
        store = store_for(pool)
        for cluster, junk in (("old-cluster", b"{not json"), ("new-cluster", b"[]")):
            bad = Incoming(TOPIC, 0, 0, b"r", junk, decode(junk, key=b"r"))
            result = await store.transact(cluster, {(TOPIC, 0): [bad]}, TenantLimits())
            assert result.effects is not None
            assert len(result.effects.dead_letters) == 1
    rows = await fetch(database, "SELECT reason, value FROM dead_letters ORDER BY id")
    assert [(r["reason"], bytes(r["value"])) for r in rows] == [
        ("malformed_json", b"{not json"),
        ("not_an_object", b"[]"),
    ]


async def _waiting_on_a_lock(database: str) -> bool:
    return (
        await count(
            database,
            """SELECT count(*) FROM pg_stat_activity
               WHERE datname = current_database() AND wait_event_type = 'Lock'""",
        )
        > 0
    )


async def test_a_batch_that_waited_on_the_fence_reads_what_its_holder_committed(
    database: str,
) -> None:
    """The fence, the runs' locks and the reads are one statement, on a snapshot taken
    before its locks: a zombie that applies part of the owner's batch (an existing run
    and a new one) while the owner waits must be seen, or the owner would number its
    checkpoints from heads that are gone."""
    first = [completed("r", updates={"i": i}) for i in range(3)]
    middle = [completed("r", updates={"i": 3}), completed("n", updates={"i": 0})]
    last = [completed("r", updates={"i": 4}), completed("n", updates={"i": 1})]
    async with connect(database, max_size=4) as pool:
        zombie, owner = store_for(pool), store_for(pool)
        await owner.transact("c", {(TOPIC, 0): records(first)}, TenantLimits())
        async with pool.acquire() as conn, conn.transaction():
            # the zombie's batch, held open: its offsets' row and run "r" locked
            fence, reads = await zombie.open(conn, "c", {(TOPIC, 0): records(middle, 3)})
            waiting = asyncio.create_task(
                owner.transact("c", {(TOPIC, 0): records(middle + last, 3)}, TenantLimits())
            )
            await wait_for(lambda: _waiting_on_a_lock(database), what="the owner to wait")
            written = await zombie.write(conn, "c", fence.fresh, TenantLimits(), reads)
            assert [c.seq for c in written.checkpoints] == [4, 1]
        result = await waiting
    assert result.progress.already_applied == 2
    assert result.effects is not None
    assert result.effects.read_again
    assert [(c.run_id, c.seq) for c in result.effects.checkpoints] == [("r", 5), ("n", 2)]
    for run, n in (("r", 5), ("n", 2)):
        rows = await fetch(
            database, "SELECT seq, state FROM checkpoints WHERE run_id = $1 ORDER BY seq", run
        )
        assert [(r["seq"], r["state"]["i"]) for r in rows] == [(s, s - 1) for s in range(1, n + 1)]


async def test_a_batch_that_waited_on_a_run_reads_the_run_again(database: str) -> None:
    """The same for a run's lock alone (the joiner's merge, ``alma replay --apply``): a
    run row changed while the batch waited for it is read again, after the lock."""
    async with connect(database, max_size=4) as pool:
        owner = store_for(pool)
        first = await owner.transact(
            "c", {(TOPIC, 0): records([completed("r", updates={"i": 0})])}, TenantLimits()
        )
        assert first.effects is not None
        assert not first.effects.read_again  # nothing in the way: one round trip
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("UPDATE runs SET status = 'running' WHERE run_id = 'r'")
            waiting = asyncio.create_task(
                owner.transact(
                    "c",
                    {(TOPIC, 0): records([completed("r", updates={"i": 1})], 1)},
                    TenantLimits(),
                )
            )
            await wait_for(lambda: _waiting_on_a_lock(database), what="the owner to wait")
        result = await waiting
    assert result.effects is not None
    assert result.effects.read_again
    assert [c.seq for c in result.effects.checkpoints] == [2]
    for unlocked in (True, False):  # the same wait, the batch read with and without locks
        async with connect(database, max_size=4) as pool:
            owner = store_for(pool, unlocked=unlocked)
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("UPDATE runs SET status = 'running' WHERE run_id = 'r'")
                offset = 2 if unlocked else 3
                waiting = asyncio.create_task(
                    owner.transact(
                        "c",
                        {(TOPIC, 0): records([completed("r", updates={"i": offset})], offset)},
                        TenantLimits(),
                    )
                )
                await wait_for(lambda: _waiting_on_a_lock(database), what="the owner to wait")
            result = await waiting
        assert result.effects is not None
        assert result.effects.read_again
        assert not result.effects.unlocked  # the check found the run changed: locked
        assert [c.seq for c in result.effects.checkpoints] == [offset + 1]


def _changing_after_the_read(monkeypatch: Any, change: Any) -> list[int]:
    """Run ``change()`` once, between a batch's reads without locks and its write: what
    another member, the joiner or a batch of another partition commits in that window.
    Returns a list that counts the batches read so."""
    real, reads = locked.load_unlocked, []

    async def read_then_change(*args: Any, **kwargs: Any) -> locked.Unlocked:
        seen = await real(*args, **kwargs)
        reads.append(1)
        if len(reads) == 1:
            await change()
        return seen

    monkeypatch.setattr(locked, "load_unlocked", read_then_change)
    return reads


async def test_a_batch_read_without_locks_is_one_checked_statement(database: str) -> None:
    """A partition's first batch makes its offsets' row under the fence; from its
    second on, a batch whose runs nobody else writes is read without locks and written
    in one statement: the same effects as under the locks."""
    async with connect(database) as pool:
        store = store_for(pool)
        first = await store.transact(
            "c", {(TOPIC, 0): records([completed("r", updates={"i": 0})])}, TenantLimits()
        )
        assert first.effects is not None
        assert not first.effects.unlocked
        docs = [completed("r", updates={"i": 1}), completed("n", state={"i": 0})]
        second = await store.transact("c", {(TOPIC, 0): records(docs, 1)}, TenantLimits())
        assert second.effects is not None
        assert second.effects.unlocked
        assert not second.effects.read_again
        assert [(c.run_id, c.seq) for c in second.effects.checkpoints] == [("r", 2), ("n", 1)]
        assert second.progress.next_offsets == {(TOPIC, 0): 3}
        assert await store.stored_offsets("c", [(TOPIC, 0)]) == {(TOPIC, 0): 3}
        again = await store.transact("c", {(TOPIC, 0): records(docs, 1)}, TenantLimits())
        assert again.effects is None
        assert again.progress.already_applied == 2
    rows = await fetch(database, "SELECT run_id, last_seq, event_count FROM runs ORDER BY run_id")
    assert [tuple(r) for r in rows] == [("n", 1, 1), ("r", 2, 2)]
    heads = await fetch(database, "SELECT run_id, seq FROM run_heads ORDER BY run_id")
    assert [tuple(r) for r in heads] == [("n", 1), ("r", 2)]


async def test_a_zombie_committing_after_an_unlocked_read_wins_alone(
    database: str, monkeypatch: Any
) -> None:
    """Another member applies the same records between the owner's read and its write:
    the owner's check finds the partition's offset moved, writes nothing, and reads
    again under the locks: the records are applied once."""
    docs = [completed("r", updates={"i": i}) for i in range(4)]
    async with connect(database, max_size=4) as pool:
        owner, zombie = store_for(pool), store_for(pool, unlocked=False)
        await owner.transact("c", {(TOPIC, 0): records(docs[:1])}, TenantLimits())

        async def zombie_applies() -> None:
            await zombie.transact("c", {(TOPIC, 0): records(docs[1:3], 1)}, TenantLimits())

        reads = _changing_after_the_read(monkeypatch, zombie_applies)
        result = await owner.transact("c", {(TOPIC, 0): records(docs[1:], 1)}, TenantLimits())
    assert reads == [1]
    assert result.effects is not None
    assert result.effects.read_again
    assert not result.effects.unlocked
    assert result.progress.already_applied == 2
    assert [c.seq for c in result.effects.checkpoints] == [4]
    rows = await fetch(database, "SELECT seq, state FROM checkpoints ORDER BY seq")
    assert [(r["seq"], r["state"]["i"]) for r in rows] == [(s, s - 1) for s in range(1, 5)]


async def _first_batches(store: PostgresCheckpointStore, other: PostgresCheckpointStore) -> None:
    """Partition 0's first batch (run "r") by ``store``, partition 1's (run "x") by
    ``other``: both partitions have their offsets' rows, so ``store`` reads unlocked."""
    await store.transact(
        "c", {(TOPIC, 0): records([completed("r", updates={"i": 0})])}, TenantLimits()
    )
    await other.transact(
        "c", {(TOPIC, 1): records([completed("x", state={"i": 0})], partition=1)}, TenantLimits()
    )


async def test_a_run_written_by_another_partition_after_an_unlocked_read(
    database: str, monkeypatch: Any
) -> None:
    """A run whose events came on two partitions (published without its key): the
    other partition's batch checkpoints it, and creates a run the batch read as new,
    between this batch's read and its write. Neither is overwritten: the check fails,
    and the batch, read again under the locks, numbers after them."""
    async with connect(database, max_size=4) as pool:
        store, other = store_for(pool), store_for(pool, unlocked=False)
        await _first_batches(store, other)

        async def other_partition_applies() -> None:
            docs = [completed("r", updates={"i": 1}), completed("n", updates={"i": 0})]
            await other.transact("c", {(TOPIC, 1): records(docs, 1, partition=1)}, TenantLimits())

        reads = _changing_after_the_read(monkeypatch, other_partition_applies)
        docs = [completed("r", updates={"i": 2}), completed("n", updates={"i": 1})]
        result = await store.transact("c", {(TOPIC, 0): records(docs, 1)}, TenantLimits())
    assert reads == [1]
    assert result.effects is not None
    assert result.effects.read_again
    assert not result.effects.unlocked
    assert [(c.run_id, c.seq) for c in result.effects.checkpoints] == [("r", 3), ("n", 2)]
    for run, n in (("r", 3), ("n", 2)):
        rows = await fetch(
            database, "SELECT seq, state FROM checkpoints WHERE run_id = $1 ORDER BY seq", run
        )
        assert [(r["seq"], r["state"]["i"]) for r in rows] == [(s, s - 1) for s in range(1, n + 1)]
    runs = await fetch(database, "SELECT run_id, last_seq, event_count FROM runs ORDER BY run_id")
    assert [tuple(r) for r in runs] == [("n", 2, 2), ("r", 3, 3), ("x", 1, 1)]


async def test_a_new_run_created_after_an_unlocked_read_is_not_overwritten(
    database: str, monkeypatch: Any
) -> None:
    """The run alone is new to the batch (no run it read changed): the write finds it
    inserted by another batch since, and the batch is read again."""
    async with connect(database, max_size=4) as pool:
        store, other = store_for(pool), store_for(pool, unlocked=False)
        await _first_batches(store, other)

        async def other_creates() -> None:
            docs = [completed("n", updates={"i": 0})]
            await other.transact("c", {(TOPIC, 1): records(docs, 1, partition=1)}, TenantLimits())

        _changing_after_the_read(monkeypatch, other_creates)
        result = await store.transact(
            "c", {(TOPIC, 0): records([completed("n", updates={"i": 1})], 1)}, TenantLimits()
        )
    assert result.effects is not None
    assert result.effects.read_again
    assert not result.effects.unlocked
    rows = await fetch(
        database, "SELECT seq, state FROM checkpoints WHERE run_id = 'n' ORDER BY seq"
    )
    assert [(r["seq"], r["state"]["i"]) for r in rows] == [(1, 0), (2, 1)]
    assert await count(database, "SELECT event_count FROM runs WHERE run_id = 'n'") == 2


async def test_a_batch_of_remembered_runs_is_checked_against_what_others_wrote(
    database: str,
) -> None:
    """With memory, a batch whose partition, runs and workflow the checkpointer wrote or
    read last folds without reading; its write still checks them all. A workflow's
    reducers registered since, and a run another batch wrote since, each fail the check:
    the batch is read again under the locks and folds with what is there now."""
    async with connect(database, max_size=4) as pool:
        store, other = store_for(pool, memory=2**20), store_for(pool, unlocked=False)
        paths = []
        for i in range(3):
            doc = completed("r", updates={"n": i})
            result = await store.transact("c", {(TOPIC, 0): records([doc], i)}, TenantLimits())
            assert result.effects is not None
            paths.append((result.effects.recalled, result.effects.read_again))
        assert paths == [(False, False), (True, False), (True, False)]  # the first: fenced
        async with pool.acquire() as conn:
            sums = ReducerConfig(field_reducers={"n": "sum"})
            await reducer_configs.save(conn, "acme", "wf", sums)
        summed = await store.transact(
            "c", {(TOPIC, 0): records([completed("r", updates={"n": 10})], 3)}, TenantLimits()
        )
        assert summed.effects is not None
        assert summed.effects.read_again  # memory had no reducers for the workflow
        assert not summed.effects.recalled
        again = await store.transact(
            "c", {(TOPIC, 0): records([completed("r", updates={"n": 1})], 4)}, TenantLimits()
        )
        assert again.effects is not None
        assert again.effects.recalled  # remembered with the reducers' version now
        await other.transact(
            "c",
            {(TOPIC, 1): records([completed("r", updates={"n": 100})], partition=1)},
            TenantLimits(),
        )
        after = await store.transact(
            "c", {(TOPIC, 0): records([completed("r", updates={"n": 1000})], 5)}, TenantLimits()
        )
        assert after.effects is not None
        assert after.effects.read_again
        assert [c.seq for c in after.effects.checkpoints] == [7]
    rows = await fetch(database, "SELECT seq, state FROM checkpoints ORDER BY seq")
    assert [(r["seq"], r["state"]["n"]) for r in rows] == [
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 12),  # 2 + 10: summed from the first batch that saw the reducers
        (5, 13),
        (6, 113),  # the other partition's
        (7, 1113),
    ]
