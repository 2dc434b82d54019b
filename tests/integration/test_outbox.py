"""The outbox relay on the real broker and PostgreSQL: each row succeeds or fails on
its own, a failed row waits with a growing delay and its error, and the rows after it
are published and marked."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from alma_core.storage import outbox
from alma_core.storage.batches import headers_json
from alma_core.storage.postgres import connect
from consumers.metrics import Metrics
from consumers.outbox import OutboxRelay
from tests.integration.conftest import Topics
from tests.integration.harness import fetch, read_topic
from tests.services import Services


async def test_a_refused_row_never_holds_back_the_others(
    services: Services, database: str, topics: Topics
) -> None:
    # The client refuses records over 1 KB: a refusal as real as a missing topic's.
    producer = AIOKafkaProducer(
        bootstrap_servers=services.kafka_bootstrap, max_request_size=1024, acks="all"
    )
    await producer.start()
    try:
        async with connect(database, max_size=2) as pool:
            async with pool.acquire() as conn:
                ids = await outbox.insert(
                    conn,
                    [
                        (topics.merged, b"k", b"first", headers_json({"n": 1})),
                        (topics.merged, b"k", b"x" * 4096, headers_json({"n": 2})),
                        (topics.merged, b"k", b"third", headers_json({"n": 3})),
                    ],
                )
            metrics = Metrics()
            relay = OutboxRelay(pool, producer, metrics, kinds={topics.merged: "reply"})
            assert await relay.publish(ids) == 2
            records = await read_topic(services.kafka_bootstrap, topics.merged, 2)
            assert [r.value for r in records] == [b"first", b"third"]
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
    finally:
        await producer.stop()
