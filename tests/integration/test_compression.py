"""ALMA's producers compress their record batches (``ALMA_KAFKA_COMPRESSION``, zstd by
default): the broker stores them compressed, and every codec is read, by the workers
(aiokafka) and by an independent client (librdkafka), on Apache Kafka and on Tansu."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from confluent_kafka import Consumer, TopicPartition

from alma_core.cli.embedded import Broker, EmbeddedStack
from alma_core.cli.embedded_kafka import KafkaBroker
from alma_core.cli.topics import ensure_topics
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from bench.peers import realistic_state
from tests.integration.conftest import TEST_PARTITIONS, Topics, settings_for
from tests.integration.harness import Worker, count, wait_for
from tests.services import Services, broker_stack

CODECS = ("zstd", "lz4", "gzip", "snappy", "none")
STEPS = 6
STATE_BYTES = 5_000


def _read_all(bootstrap: str, topic: str, expected: int) -> list[dict[str, Any]]:
    """Every record of ``topic``, read with librdkafka (not the workers' client)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=20).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        docs: list[dict[str, Any]] = []
        for _ in range(200):  # at most 200 polls of 0.2 s
            if len(docs) >= expected:
                break
            message = consumer.poll(0.2)
            if message is None:
                continue
            assert message.error() is None, message.error()
            docs.append(json.loads(message.value()))
        return docs
    finally:
        consumer.close()


async def _every_codec_applied(settings: Settings) -> None:
    """An orchestrator per codec, each its own runs: every event applied once by one
    worker, and read back whole by librdkafka."""
    sent: dict[str, dict[str, Any]] = {}  # event id -> its state
    async with Worker.start(settings):
        for codec in CODECS:
            mine = settings.model_copy(update={"kafka_compression": codec})
            async with AlmaClient(mine) as client:
                run = WorkflowContext("acme", "wf", None, f"run-{codec}", "n")
                for step in range(STEPS):
                    state = {**realistic_state(STATE_BYTES, seed=step), "step": step}
                    event_id = await client.node_completed(run, state=state)
                    sent[event_id] = state
        total = len(CODECS) * STEPS

        async def applied() -> bool:
            dsn = settings.postgres_dsn or ""
            return await count(dsn, "SELECT count(*) FROM checkpoints") >= total

        await wait_for(applied, what="every codec's events checkpointed")
    conn = await asyncpg.connect(settings.postgres_dsn)
    try:
        rows = await conn.fetch("SELECT event_id, state::text AS state FROM checkpoints")
    finally:
        await conn.close()
    assert sorted(r["event_id"] for r in rows) == sorted(sent)  # each once
    assert all(json.loads(r["state"]) == sent[r["event_id"]] for r in rows)
    docs = await asyncio.to_thread(
        _read_all, settings.kafka_bootstrap or "", settings.lifecycle_topic, total
    )
    assert sorted(d["event_id"] for d in docs) == sorted(sent)
    assert all(d["payload"]["state"] == sent[d["event_id"]] for d in docs)


async def test_every_codec_is_read_on_the_suites_broker(settings: Settings) -> None:
    """On Apache Kafka (ALMA_TEST_BROKER=tansu: Tansu)."""
    await _every_codec_applied(settings)


async def test_every_codec_is_read_on_tansu(
    services: Services, database: str, tmp_path: Path
) -> None:
    broker = Broker(tmp_path)
    await broker.start()
    try:
        topics = Topics.fresh()
        await ensure_topics(broker.url, topics.all, partitions=TEST_PARTITIONS)
        await _every_codec_applied(
            settings_for(broker.url, database, services.redis_url, topics, broker="tansu")
        )
    finally:
        await broker.stop()


@pytest.fixture
async def kafka(tmp_path: Path) -> Any:
    """An Apache Kafka of this test alone: its log directory is read."""
    async with broker_stack(tmp_path / "kafka", "kafka") as stack:
        yield stack


async def test_the_broker_stores_what_alma_sends_compressed(
    kafka: EmbeddedStack, services: Services, database: str
) -> None:
    """The same agents' states sent with the default codec take under half the bytes on
    the broker's disk that they take sent uncompressed."""
    assert isinstance(kafka.broker, KafkaBroker)
    bootstrap = kafka.endpoints.kafka_bootstrap
    stored: dict[str, int] = {}
    for codec in ("zstd", "none"):
        topics = Topics.fresh()
        await ensure_topics(bootstrap, topics.all, partitions=1)
        s = settings_for(bootstrap, database, services.redis_url, topics, partitions=1)
        if codec != "zstd":
            s = s.model_copy(update={"kafka_compression": codec})
        else:
            assert s.kafka_compression == "zstd"  # the default
        async with AlmaClient(s) as client:
            for step in range(40):
                run = WorkflowContext("acme", "wf", None, "run-1", "n")
                await client.node_completed(run, state=realistic_state(STATE_BYTES, step))
        logs = kafka.broker.log_dir / f"{topics.lifecycle}-0"
        stored[codec] = sum(p.stat().st_size for p in logs.glob("*.log"))
    assert stored["none"] > 35 * STATE_BYTES  # every state, whole
    # each state its own batch (the SDK sends as soon as asked): 0.35 of it on this
    # machine (a batch of 16 such states: 0.24)
    assert stored["zstd"] < stored["none"] / 2, stored
