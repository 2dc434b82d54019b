"""Offsets against the broker's log. Stored offsets beyond the end of the log (the
broker lost or replaced it) are never trusted silently: the partition pauses, a metric
and an error say so, and nothing is skipped as "already applied"; `alma offsets reset`
forgets them and the records of the new log are applied. Offsets inside the log that
hold no record (a transaction's commit marker, records deleted by retention) never
stall a partition."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from confluent_kafka import Producer

from alma_core.cli.offsets import cluster_id
from alma_core.settings import Settings
from tests.integration.conftest import TEST_PARTITIONS
from tests.integration.harness import Publisher, Worker, completed, count, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of


async def test_offsets_beyond_the_log_pause_until_reset(settings: Settings) -> None:
    # a log short of the stored offsets for longer than a leader change takes to settle
    settings = settings.model_copy(update={"log_behind_grace_s": 1.0})
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    group = f"{settings.group_prefix}-checkpointer"
    cluster = await cluster_id(bootstrap)
    conn = await asyncpg.connect(dsn)
    try:  # what a group remembers from a broker whose log is gone (same cluster id)
        await conn.executemany(
            """INSERT INTO consumer_offsets (group_id, cluster_id, topic, partition, next_offset)
               VALUES ($1, $2, $3, $4, 1000)""",
            [(group, cluster, settings.lifecycle_topic, p) for p in range(TEST_PARTITIONS)],
        )
    finally:
        await conn.close()
    events = [completed("after-loss", state={"n": i}) for i in range(3)]
    async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
        for doc in events:
            await pub.send(doc)
        await pub.flush()

    async with Worker.start(settings) as worker:

        def behind() -> float:
            return sum(
                worker.value(
                    "alma_offsets_ahead_of_log",
                    {
                        "consumer": "checkpointer",
                        "topic": settings.lifecycle_topic,
                        "partition": str(p),
                    },
                )
                for p in range(TEST_PARTITIONS)
            )

        (runtime,) = worker.status.runtimes
        assert runtime.consumer is not None

        async def reported() -> bool:
            return len(runtime.assignment.log_behind) == TEST_PARTITIONS and behind() > 0

        await wait_for(reported, what="the partitions reported behind their stored offsets")
        # paused, not merely filtered: nothing of theirs is fetched (or skipped as applied)
        paused = {tp.partition for tp in runtime.consumer.paused()}
        assert paused == set(range(TEST_PARTITIONS))
        assert await count(dsn, "SELECT count(*) FROM run_events") == 0
        assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0

    reset = alma(
        "offsets",
        "reset",
        "--group",
        group,
        "--topic",
        settings.lifecycle_topic,
        env=env_of(settings),
    )
    assert reset.returncode == 0, reset.stderr
    assert "forgot" in reset.stdout
    again = alma(
        "offsets",
        "reset",
        "--group",
        group,
        "--topic",
        settings.lifecycle_topic,
        env=env_of(settings),
    )
    assert again.returncode == 1
    assert "alma offsets list" in again.stderr

    async with Worker.start(settings):

        async def applied() -> bool:
            return await count(dsn, "SELECT count(*) FROM run_events") == len(events)

        await wait_for(applied, what="the new log's records once the offsets were reset")


async def equals(read: Callable[[], Awaitable[int]], n: int) -> bool:
    return await read() == n


def transactional_producer(bootstrap: str, topic: str, docs: list[dict[str, Any]]) -> None:
    """An upstream producer that writes in Kafka transactions (confluent-kafka, a client
    independent of ours): each commit leaves a marker that takes an offset and is never
    delivered as a record."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": uuid.uuid4().hex})
    producer.init_transactions(10)
    producer.begin_transaction()
    for doc in docs:
        producer.produce(topic, json.dumps(doc).encode(), key=doc["run_id"].encode())
    producer.commit_transaction(10)


async def test_offsets_with_no_record_in_the_log_never_stall_a_partition(
    settings: Settings,
) -> None:
    """Kafka transactions upstream: the commit marker after each transaction takes an
    offset that no consumer ever receives. A batch that starts after one must be
    applied, not sent back for the missing offset forever."""
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    first = [completed("tx", state={"n": i}) for i in range(2)]
    later = [completed("tx", state={"n": i}) for i in range(2, 5)]
    async with Worker.start(settings) as worker:
        await asyncio.to_thread(transactional_producer, bootstrap, settings.lifecycle_topic, first)

        async def checkpoints() -> int:
            return await count(dsn, "SELECT count(*) FROM checkpoints")

        await wait_for(lambda: equals(checkpoints, 2), what="the transaction's two events")
        # the next batch starts after the commit marker's offset
        await asyncio.to_thread(transactional_producer, bootstrap, settings.lifecycle_topic, later)
        await wait_for(lambda: equals(checkpoints, 5), limit_s=30, what="the events after it")
        assert worker.value("alma_offsets_skipped_total", {"consumer": "checkpointer"}) >= 1
    rows = await count(dsn, "SELECT max(seq) FROM checkpoints WHERE run_id = 'tx'")
    assert rows == 5
    assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0
