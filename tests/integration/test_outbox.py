"""The outbox relay on the real broker and PostgreSQL: rows of one run's hand-offs or
replies (one topic and key) leave in the order they were written, a row Kafka refuses
holds back only the rows after it of its own topic and key (and no dead letter), it
waits with a growing delay and its error, and two relays never publish one row at the
same time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
from aiokafka import AIOKafkaProducer

from alma_core.consumers.metrics import Metrics
from alma_core.consumers.outbox import OutboxRelay
from alma_core.storage import outbox
from alma_core.storage.dead_letters import headers_json
from alma_core.storage.postgres import connect
from tests.integration.conftest import Topics
from tests.integration.harness import fetch, read_topic
from tests.services import Services


@contextlib.asynccontextmanager
async def refusing_producer(bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    """A producer that refuses records over 1 KB: a refusal as real as a missing topic's."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=1024, acks="all")
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def insert(pool: asyncpg.Pool, rows: list[tuple[str, bytes, bytes]]) -> list[int]:
    async with pool.acquire() as conn:
        return await outbox.insert(
            conn, [(t, k, v, headers_json({"n": i})) for i, (t, k, v) in enumerate(rows)]
        )


async def test_a_refused_row_holds_back_only_its_own_run(
    services: Services, database: str, topics: Topics
) -> None:
    async with (
        refusing_producer(services.kafka_bootstrap) as producer,
        connect(database, max_size=2) as pool,
    ):
        ids = await insert(
            pool,
            [
                (topics.merged, b"k1", b"first"),
                (topics.merged, b"k2", b"x" * 4096),
                (topics.merged, b"k3", b"third"),
            ],
        )
        metrics = Metrics()
        relay = OutboxRelay(pool, producer, metrics, kinds={topics.merged: "reply"})
        assert await relay.publish(ids) == 2
        records = await read_topic(services.kafka_bootstrap, topics.merged, 2)
        assert sorted(r.value for r in records) == [b"first", b"third"]
        rows = await fetch(
            database,
            "SELECT id, published_at IS NOT NULL AS published, "
            "attempts, last_error, next_attempt_at > now() AS later "
            "FROM outbox ORDER BY id",
        )
        assert [r["published"] for r in rows] == [True, False, True]
        refused = rows[1]
        assert refused["attempts"] == 1
        assert "MessageSizeTooLarge" in refused["last_error"]
        assert refused["later"]
        assert metrics.registry.get_sample_value("alma_outbox_failures_total") == 1
        # Before its next attempt is due, a sweep leaves the refused row alone.
        assert await relay.sweep(force=True) == 0
        again = await fetch(database, "SELECT attempts FROM outbox WHERE id = $1", ids[1])
        assert again[0]["attempts"] == 1


async def test_rows_of_one_run_leave_in_the_order_they_were_written(
    services: Services, database: str, topics: Topics
) -> None:
    """A run's first reply is refused (for now): its second waits for it, whatever
    else goes out meanwhile (another run's reply, the run's dead letter: dead letters
    are independent records). Once the first goes out, the second follows it."""
    async with (
        refusing_producer(services.kafka_bootstrap) as producer,
        connect(database, max_size=2) as pool,
    ):
        ids = await insert(
            pool,
            [
                (topics.merged, b"run", b"x" * 4096),  # refused until healed below
                (topics.merged, b"run", b"second"),
                (topics.merged, b"other", b"other run"),
                (topics.dlq, b"run", b"a dead letter"),
            ],
        )
        relay = OutboxRelay(
            pool, producer, Metrics(), kinds={topics.merged: "reply", topics.dlq: "dlq"}
        )
        assert await relay.publish(ids) == 2
        letters = await read_topic(services.kafka_bootstrap, topics.dlq, 1)
        assert [r.value for r in letters] == [b"a dead letter"]
        replies = await read_topic(services.kafka_bootstrap, topics.merged, 1)
        assert [r.value for r in replies] == [b"other run"]
        # the refusal was passing (a topic created late, a leader moving): it goes now
        async with pool.acquire() as conn:
            await conn.execute(
                "UPDATE outbox SET value = 'first', next_attempt_at = now() WHERE id = $1",
                ids[0],
            )
        assert await relay.sweep(force=True) == 2
        replies = await read_topic(services.kafka_bootstrap, topics.merged, 3)
        assert [r.value for r in replies if r.key == b"run"] == [b"first", b"second"]


async def test_two_relays_never_publish_one_row_twice(
    services: Services, database: str, topics: Topics
) -> None:
    """Two workers' relays sweep the same rows left behind by a crash at the same time:
    each row goes out once, and each run's rows in order."""
    rows = [(topics.sequenced, f"run-{i % 20}".encode(), f"{i}".encode()) for i in range(300)]
    async with (
        connect(database, max_size=4) as pool_a,
        connect(database, max_size=4) as pool_b,
    ):
        await insert(pool_a, rows)
        await pool_a.execute("UPDATE outbox SET created_at = now() - interval '1 minute'")
        producers = [AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all")]
        producers.append(AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all"))
        for p in producers:
            await p.start()
        try:
            kinds = {topics.sequenced: "handoff"}
            relays = [
                OutboxRelay(pool, producer, Metrics(), kinds=kinds)
                for pool, producer in zip((pool_a, pool_b), producers, strict=True)
            ]
            sent = 0
            for _ in range(20):  # bounded: a sweep takes at most 1,000 rows
                sent += sum(await asyncio.gather(*(r.sweep(force=True) for r in relays)))
                if sent >= len(rows):
                    break
            assert sent == len(rows)
        finally:
            for p in producers:
                await p.stop()
    records = await read_topic(services.kafka_bootstrap, topics.sequenced, len(rows))
    assert sorted(int(r.value) for r in records) == list(range(len(rows)))
    by_run: dict[bytes, list[int]] = {}
    for r in records:
        by_run.setdefault(r.key, []).append(int(r.value))
    assert all(values == sorted(values) for values in by_run.values())
