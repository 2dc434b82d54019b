"""`alma lag-exporter` on the real broker: lag from the broker's view of the groups,
so a group that stopped consuming shows its lag growing (a worker's own lag gauge
freezes with the worker), and kafka_exporter's metric names over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from alma_core.consumers.lag import lag_of, run_lag_exporter
from alma_core.consumers.metrics import ExporterMetrics
from alma_core.settings import Settings
from tests.integration.harness import Publisher, Worker, completed, wait_for
from tests.integration.test_http import get


@pytest.fixture
async def exporter(settings: Settings) -> AsyncIterator[tuple[ExporterMetrics, int]]:
    metrics, stop = ExporterMetrics(), asyncio.Event()
    listening: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_lag_exporter(
            settings,
            settings.kafka_bootstrap or "",
            stop,
            port=0,
            interval_s=0.3,
            metrics=metrics,
            listening=listening,
        )
    )
    port = await asyncio.wait_for(listening, 10)
    try:
        yield metrics, port
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def offsets(metrics: ExporterMetrics, group: str) -> dict[str, float]:
    return {
        s.labels["partition"]: s.value
        for m in metrics.registry.collect()
        if m.name == "kafka_consumergroup_current_offset"
        for s in m.samples
        if s.labels["consumergroup"] == group
    }


async def publish(settings: Settings, runs: list[str]) -> None:
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for run in runs:
            await pub.send(completed(run, updates={"x": 1}))
        await pub.flush()


async def test_the_broker_view_of_lag_follows_a_group_that_stopped(
    settings: Settings, exporter: tuple[ExporterMetrics, int]
) -> None:
    metrics, port = exporter
    group = f"{settings.group_prefix}-checkpointer"
    topic = settings.lifecycle_topic

    def lag() -> float | None:
        return metrics.registry.get_sample_value(
            "kafka_consumergroup_lag_sum", {"consumergroup": group, "topic": topic}
        )

    def members() -> float | None:
        return metrics.registry.get_sample_value(
            "kafka_consumergroup_members", {"consumergroup": group}
        )

    async def shows(expected_lag: int, expected_members: int) -> bool:
        return (lag(), members()) == (expected_lag, expected_members)

    # nothing consumes yet: every record is lag (batched records too: the exact end)
    await publish(settings, [f"before-{i}" for i in range(7)])
    await wait_for(lambda: shows(7, 0), what="lag 7 with no member")
    # a fresh broker may answer the first reads with no coordinator for the group yet
    # (GroupCoordinatorNotAvailable: counted, retried); from here on, none may fail
    errors_before = metrics.registry.get_sample_value("alma_lag_exporter_errors_total")
    ends = [
        s.value
        for s in metrics.registry.collect()
        if s.name == "kafka_topic_partition_current_offset"
        for s in s.samples
        if s.labels["topic"] == topic
    ]
    assert sum(ends) == 7

    async with Worker.start(settings) as worker:
        await wait_for(lambda: shows(0, 1), limit_s=30, what="lag 0 with one member")
        assert worker.value("alma_consumer_lag", {"consumer": "checkpointer"}) == 0

    # the group is gone: its lag grows as records arrive, though nobody reports it. (The
    # embedded broker goes on listing the member that left, so members is not checked
    # here; the alert for a stuck group is lag with no committed progress, which holds
    # for a hung member too.)
    committed = offsets(metrics, group)
    await publish(settings, [f"after-{i}" for i in range(4)])

    async def grown() -> bool:
        return lag() == 4

    await wait_for(grown, what="lag 4 after the group stopped")
    assert offsets(metrics, group) == committed  # no progress: what the alert looks at

    status, text = await get(port, "/metrics")
    assert status == 200
    assert f'kafka_consumergroup_lag{{consumergroup="{group}"' in text
    assert "process_resident_memory_bytes" in text
    assert "alma_lag_exporter_last_success_timestamp_seconds" in text
    assert (await get(port, "/readyz"))[0] == 200
    errors_after = metrics.registry.get_sample_value("alma_lag_exporter_errors_total")
    assert errors_after == errors_before


def test_lag_of_a_partition() -> None:
    assert lag_of(None, 0, 10) == 10  # never committed: reads from the start
    assert lag_of(4, 0, 10) == 6
    assert lag_of(10, 0, 10) == 0
    assert lag_of(2, 5, 10) == 5  # committed before the log's start (retention)
    assert lag_of(12, 0, 10) == 0  # beyond the end (a broker that lost records)
