"""Faults that only Apache Kafka has, on a real one (docs/kafka.md): the broker
SIGKILLed and restarted on its log mid-stream, with and without PostgreSQL down at the
same time; records removed by retention before a stopped group read them; more
partitions than the suite's topics have. Every seq gapless, every effect once, nothing
the broker acknowledged lost."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from aiokafka.errors import KafkaError

from alma_core.cli.embedded import EmbeddedStack
from alma_core.cli.embedded_kafka import KafkaBroker
from alma_core.cli.topics import ensure_topics
from alma_core.settings import Settings
from tests.integration.conftest import PrivateStack, Topics, settings_for
from tests.integration.harness import (
    Publisher,
    Worker,
    assert_exactly_once,
    completed,
    count,
    wait_for,
)
from tests.services import Services, broker_stack

RUNS = 6
STEPS = 25
SEND_LIMIT_S = 60.0  # one event's sends and resends, the broker's restart included


@pytest.fixture
async def kafka(tmp_path: Path) -> AsyncIterator[EmbeddedStack]:
    """An Apache Kafka of this test alone, so the test can kill it."""
    async with broker_stack(tmp_path / "kafka", "kafka") as stack:
        yield stack


def _broker(stack: EmbeddedStack) -> KafkaBroker:
    assert isinstance(stack.broker, KafkaBroker)
    return stack.broker


async def publish_until_acknowledged(
    bootstrap: str, topic: str, published: dict[str, list[dict[str, Any]]], acked: asyncio.Event
) -> int:
    """Each run's events one after another, each sent again (the same event id) until
    the broker acknowledges it, as an orchestrator's retry does; ``acked`` is set once a
    third of them are. Returns how many sends failed."""
    failed = 0
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        request_timeout_ms=5000,
        retry_backoff_ms=200,
    )
    await producer.start()
    try:
        total = 0
        for step in range(STEPS):
            for run in published:
                doc = completed(run, node=f"n{step}", updates={"step": step, "history": [step]})
                deadline = time.monotonic() + SEND_LIMIT_S
                while True:
                    try:
                        await producer.send_and_wait(topic, _json(doc), key=run.encode())
                        break
                    except KafkaError:
                        failed += 1
                        assert time.monotonic() < deadline, f"{doc['event_id']} never acked"
                        await asyncio.sleep(0.2)
                published[run].append(doc)
                total += 1
                if total >= RUNS * STEPS // 3:
                    acked.set()
    finally:
        await producer.stop()
    return failed


def _json(doc: dict[str, Any]) -> bytes:
    import json

    return json.dumps(doc).encode()


async def _apply_through_a_broker_restart(
    stack: EmbeddedStack, settings: Settings, during_restart: Any = None
) -> dict[str, list[dict[str, Any]]]:
    broker = _broker(stack)
    published: dict[str, list[dict[str, Any]]] = {f"run-{i}": [] for i in range(RUNS)}
    acked = asyncio.Event()
    async with Worker.start(settings) as worker:
        sending = asyncio.create_task(
            publish_until_acknowledged(broker.url, settings.lifecycle_topic, published, acked)
        )
        await asyncio.wait_for(acked.wait(), 60)
        assert not sending.done(), "the broker dies mid-stream, with events still to send"
        broker.kill()  # SIGKILL: no controlled shutdown, no flush
        if during_restart is not None:
            await during_restart()
        await broker.start(port=broker.port)  # on its log, at the same address
        await asyncio.wait_for(sending, 120)
        dsn = settings.postgres_dsn
        assert dsn

        async def all_applied() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") >= RUNS * STEPS

        await wait_for(all_applied, limit_s=90, what="every acknowledged event applied")
        assert worker.task is not None
        assert not worker.task.done(), "the worker went on through the broker's restart"
    return published


@pytest.mark.chaos
async def test_a_broker_sigkilled_mid_stream_comes_back_with_everything_it_acknowledged(
    kafka: EmbeddedStack, services: Services, database: str
) -> None:
    topics = Topics.fresh()
    broker = _broker(kafka)
    await ensure_topics(broker.url, topics.all, partitions=4)
    settings = settings_for(broker.url, database, services.redis_url, topics)
    cluster = broker.cluster_id
    published = await _apply_through_a_broker_restart(kafka, settings)
    assert broker.cluster_id == cluster, "the same cluster: offsets stored stay valid"
    await assert_exactly_once(database, published)


@pytest.mark.chaos
async def test_a_broker_restart_while_postgres_is_down(
    kafka: EmbeddedStack, private_stack: PrivateStack
) -> None:
    """The worker retries storage while the broker is gone too; both come back, and
    the stored offsets (keyed by the broker's unchanged cluster id) carry it on."""
    topics = Topics.fresh()
    broker = _broker(kafka)
    await ensure_topics(broker.url, topics.all, partitions=4)
    base = private_stack.settings
    assert base.postgres_dsn
    assert base.redis_url
    settings = settings_for(broker.url, base.postgres_dsn, base.redis_url, topics)

    async def postgres_down_then_up() -> None:
        private_stack.postgres.kill()
        await asyncio.sleep(2)  # the worker meets the outage and retries
        await private_stack.postgres.start(port=private_stack.postgres.port)

    published = await _apply_through_a_broker_restart(kafka, settings, postgres_down_then_up)
    await assert_exactly_once(base.postgres_dsn, published)


async def test_records_removed_by_retention_before_the_group_read_them_are_counted(
    services: Services, settings: Settings
) -> None:
    """Retention moves the log's start past what a stopped group had applied: the
    group goes on from the new start, and the records it never saw are counted in
    alma_offsets_skipped_total (and logged), never silently."""
    bootstrap = services.kafka_bootstrap
    topic = settings.lifecycle_topic
    dsn = settings.postgres_dsn
    assert dsn
    run = "kept-and-lost"
    async with Publisher(bootstrap, topic) as pub:
        for i in range(3):
            await pub.send(completed(run, updates={"i": i}))
        await pub.flush()
        async with Worker.start(settings):
            await wait_for(lambda: _checkpoints(dsn, 3), what="the first three applied")
        for i in range(3, 8):  # published while the group is stopped, never read
            await pub.send(completed(run, updates={"i": i}))
        await pub.flush()
        partition = await _partition_of(bootstrap, topic, run)
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:  # what retention does to old segments: the log now starts at offset 6
            moved = await admin.delete_records({partition: RecordsToDelete(before_offset=6)})
        finally:
            await admin.close()
        assert moved[partition] == 6
        for i in range(8, 10):
            await pub.send(completed(run, updates={"i": i}))
        await pub.flush()
    async with Worker.start(settings) as worker:
        await wait_for(lambda: _checkpoints(dsn, 7), what="the records left applied")
        assert worker.value("alma_offsets_skipped_total", {"consumer": "checkpointer"}) == 3
    rows = await _states(dsn, run)
    assert [r["i"] for r in rows] == [0, 1, 2, 6, 7, 8, 9]


async def test_more_partitions_than_the_suite_uses(services: Services, database: str) -> None:
    """24 partitions (the suite's topics have 4): created, every one has its leader at
    once (Kafka answers CreateTopics before electing them); every run lands whole in
    one, and the checkpointer applies them all in order."""
    topics = Topics.fresh()
    await ensure_topics(services.kafka_bootstrap, topics.all, partitions=24)
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(topics.all)
    finally:
        await admin.close()
    leaders = {
        (d["topic"], p["partition"]): p["leader"] for d in described for p in d["partitions"]
    }
    assert len(leaders) == 24 * len(topics.all)
    assert all(leader >= 0 for leader in leaders.values()), leaders
    settings = settings_for(
        services.kafka_bootstrap, database, services.redis_url, topics, partitions=24
    )
    published: dict[str, list[dict[str, Any]]] = {f"wide-{i}": [] for i in range(48)}
    async with Publisher(services.kafka_bootstrap, topics.lifecycle) as pub:
        for step in range(3):
            for run, docs in published.items():
                doc = completed(run, node=f"n{step}", updates={"step": step, "history": [step]})
                docs.append(doc)
                await pub.send(doc)
        await pub.flush()
    async with Worker.start(settings):
        await wait_for(lambda: _checkpoints(database, 48 * 3), what="every run applied")
    await assert_exactly_once(database, published)


async def _checkpoints(dsn: str, at_least: int) -> bool:
    return await count(dsn, "SELECT count(*) FROM checkpoints") >= at_least


async def _states(dsn: str, run: str) -> list[dict[str, Any]]:
    from tests.integration.harness import fetch

    rows = await fetch(dsn, "SELECT state FROM checkpoints WHERE run_id = $1 ORDER BY seq", run)
    import json

    return [json.loads(r["state"]) if isinstance(r["state"], str) else r["state"] for r in rows]


async def _partition_of(bootstrap: str, topic: str, key: str) -> TopicPartition:
    """The partition the default partitioner chose for ``key`` (murmur2, as Java's)."""
    from aiokafka.partitioner import DefaultPartitioner

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    n = len(described[0]["partitions"])
    index = DefaultPartitioner()(key.encode(), list(range(n)), list(range(n)))
    return TopicPartition(topic, index)


async def test_the_topics_alma_creates_take_the_records_it_accepts(
    services: Services, settings: Settings
) -> None:
    """Apache Kafka refuses records over 1 MB by default, ALMA accepts 8 MB: the topics
    ALMA creates take what it accepts (a 3 MB record lands, and reaches the dead
    letters as too large for the state limit rather than being refused at the door),
    and a worker whose fetches bring far less at once (ALMA_FETCH_MAX_BYTES, 64 KiB
    here) still gets it whole."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, settings.lifecycle_topic)]
        )
    finally:
        await admin.close()
    configs = {e[0]: e[1] for r in described.resources for e in r[4]}
    assert int(configs["max.message.bytes"]) >= settings.max_record_bytes
    big = completed("big-one", state={"blob": "x" * (3 << 20)})
    async with Publisher(services.kafka_bootstrap, settings.lifecycle_topic) as pub:
        await pub.send(big)
        await pub.flush()  # MessageSizeTooLargeError here on a topic of Kafka's defaults
    dsn = settings.postgres_dsn
    assert dsn
    async with Worker.start(settings.model_copy(update={"fetch_max_bytes": 64 << 10})):
        await wait_for(
            lambda: count(
                dsn, "SELECT count(*) FROM dead_letters WHERE reason = 'state_too_large'"
            ),
            what="the 3 MB state dead-lettered as too large",
        )


async def test_a_cluster_id_that_begins_with_a_dash_formats_and_sigint_ignored_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A KRaft cluster id is base64: 1 in 32 begins with "-", which the storage tool's
    parser took for an option (the suite's broker failed to start once in a while).

    Started by a process that ignores SIGINT (a job a non-interactive shell puts in the
    background: `alma up &`, a script, CI), the JVM ignores SIGINT too: the broker is
    stopped with SIGTERM, its own stop signal, and shuts down rather than being killed
    once the grace runs out (it was, in every full run of the suite)."""
    from alma_core.cli import embedded_kafka

    monkeypatch.setattr(embedded_kafka, "new_cluster_id", lambda: "-" + "A" * 21)
    broker = KafkaBroker(tmp_path / "kafka", tmp_path / "run", libs=embedded_kafka.default_libs())
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        await broker.start()  # the JVM inherits SIGINT ignored
    finally:
        signal.signal(signal.SIGINT, before)
    proc = broker.proc
    assert proc is not None
    try:
        assert broker.cluster_id == "-" + "A" * 21
    finally:
        await broker.stop()
    assert proc.returncode != -signal.SIGKILL  # it shut down: not killed after the grace
    assert "did not stop" not in caplog.text


async def test_alma_topics_describe_checks_the_topics_on_the_broker(
    services: Services, settings: Settings
) -> None:
    """`alma topics describe` on the real broker: the partitions, replication,
    min.insync.replicas, retention, largest record and codec of ALMA's topics (created as
    `alma topics create` creates them), with the deploy files' retention, find nothing
    wrong; a lifecycle topic that keeps records forever, or recompresses what ALMA's
    producers send, is named, with what to do (exit 1)."""
    import json

    import yaml
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from tests.integration.test_cli import alma
    from tests.integration.test_cli_runs import env_of
    from tests.readme_blocks import ROOT

    env = env_of(settings)
    described = await asyncio.to_thread(alma, "topics", "describe", "--json", env=env)
    assert described.returncode == 0, described.stderr
    docs = {d["name"]: d for d in json.loads(described.stdout)}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    hours = compose["x-kafka-env"]["KAFKA_LOG_RETENTION_HOURS"]  # every broker's
    for topic in (settings.lifecycle_topic, settings.merged_topic, settings.dlq_topic):
        doc = docs[topic]
        assert doc["partitions"] == settings.partitions, doc
        assert doc["replication_factor"] == settings.replication_factor == 1
        assert doc["max_message_bytes"] == settings.max_record_bytes + 64 * 1024
        assert doc["retention_ms"] == hours * 3_600_000  # the deploy files' retention
        assert doc["compression_type"] == "producer"  # ALMA's producers' codec is kept
        assert doc["problems"] == [], doc
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    await admin.start()
    try:
        forever = {"retention.ms": "-1", "compression.type": "gzip"}
        await admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, settings.lifecycle_topic, forever)]
        )
    finally:
        await admin.close()

    async def told() -> bool:
        again = await asyncio.to_thread(alma, "topics", "describe", env=env)
        named = "keeps records forever", "compression.type=gzip, where ALMA's producers send"
        return again.returncode == 1 and all(n in again.stderr for n in named)

    await wait_for(told, what="the lifecycle topic's infinite retention and codec named")
