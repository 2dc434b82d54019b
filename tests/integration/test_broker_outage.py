"""The broker dies under a worker that still holds fetched records: their effects are
durable in PostgreSQL (the stored offsets are the truth), the Kafka offset commits
that follow fail, are counted in ``alma_offset_commit_failures_total`` (what the
AlmaOffsetCommitFailing alert reads) and logged, and the worker stops cleanly."""

from __future__ import annotations

from pathlib import Path

from alma_core.cli.embedded import Broker
from alma_core.cli.topics import ensure_topics
from tests.integration.conftest import TEST_PARTITIONS, Topics, settings_for
from tests.integration.harness import Publisher, Worker, completed, count, wait_for
from tests.services import Services

RECORDS = 4000


async def test_commits_to_a_dead_broker_are_counted_not_fatal(
    services: Services, database: str, tmp_path: Path
) -> None:
    broker = Broker(tmp_path)
    await broker.start()
    try:
        topics = Topics.fresh()
        await ensure_topics(broker.url, topics.all, partitions=TEST_PARTITIONS)
        settings = settings_for(broker.url, database, services.redis_url, topics, broker="tansu")
        async with Publisher(broker.url, topics.lifecycle) as pub:
            for i in range(RECORDS):  # a backlog the worker fetches ahead of applying
                await pub.send(completed(f"run-{i % 40}", updates={"i": i, "pad": "x" * 600}))
            await pub.flush()
        async with Worker.start(settings) as worker:

            async def started() -> bool:
                return await count(database, "SELECT count(*) FROM checkpoints") >= 200

            await wait_for(started, what="the first checkpoints")
            broker.kill()
            failures = {"consumer": "checkpointer"}

            async def counted() -> bool:
                return worker.value("alma_offset_commit_failures_total", failures) > 0

            await wait_for(counted, limit_s=30, what="a failed offset commit, counted")
            applied = await count(database, "SELECT count(*) FROM checkpoints")
            assert 200 <= applied <= RECORDS
    finally:
        await broker.stop()
