"""Consumer lag from the broker's view of each group: ``alma lag-exporter``.

A worker's own ``alma_consumer_lag`` is computed inside the consumer after each
batch, so a group that died or hangs shows a frozen lag, or none, and an alert or
an autoscaler reading it stays quiet. This process asks the broker instead, every
few seconds: the offsets each ALMA group committed (Kafka's group offsets, which the
runtime commits after its PostgreSQL commit) against where each partition ends,
and how many members each group has. It exports them under kafka_exporter's metric
names, so dashboards, alerts and autoscalers work the same with either exporter.

Where a partition ends: the high watermark from a fetch of its last batch (exact
on every broker; the embedded one answers ListOffsets with the start of its last
batch), falling back to ListOffsets when the fetch returns nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from alma_core.messaging import kafka
from alma_core.settings import Settings
from consumers import checkpointer, http, joiner, learner
from consumers.metrics import ExporterMetrics

log = logging.getLogger("alma.lag")

Partition = tuple[str, int]  # topic, partition


def alma_groups(settings: Settings) -> dict[str, str]:
    """Each ALMA consumer group and the topic it reads."""
    prefix = settings.group_prefix
    return {
        f"{prefix}-{checkpointer.GROUP}": settings.lifecycle_topic,
        f"{prefix}-{joiner.GROUP}": settings.sequenced_topic,
        f"{prefix}-{learner.GROUP}": settings.sequenced_topic,
    }


def lag_of(committed: int | None, start: int, end: int) -> int:
    """Records a group has still to read in one partition. A group that never
    committed there reads from the start of the log (``auto_offset_reset`` earliest);
    an offset outside the log counts from the nearer end."""
    position = start if committed is None else min(max(committed, start), end)
    return end - position


@dataclass(frozen=True)
class GroupView:
    """One group as the broker sees it (``members`` None: the broker did not say)."""

    members: int | None
    committed: dict[Partition, int | None]


@dataclass(frozen=True)
class Snapshot:
    ends: dict[Partition, int]
    starts: dict[Partition, int]
    groups: dict[str, GroupView]

    def lag(self, group: str) -> dict[Partition, int]:
        view = self.groups[group]
        return {
            p: lag_of(c, self.starts.get(p, 0), self.ends[p])
            for p, c in view.committed.items()
            if p in self.ends
        }


class LagExporter:
    def __init__(
        self,
        bootstrap: str,
        groups: dict[str, str],
        metrics: ExporterMetrics,
        *,
        client_options: dict[str, Any] | None = None,
        interval_s: float = 15.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.groups = groups
        self.metrics = metrics
        self.options = client_options or {}
        self.interval_s = interval_s
        self.last_success = 0.0  # monotonic
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> LagExporter:
        self._admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap, request_timeout_ms=10_000, **self.options
        )
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            max_partition_fetch_bytes=64 * 1024,
            fetch_max_wait_ms=100,
            **self.options,
        )
        await self._admin.start()
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
        if self._admin is not None:
            await self._admin.close()

    async def _partitions(self) -> list[TopicPartition]:
        assert self._admin is not None
        topics = sorted(set(self.groups.values()))
        described = await self._admin.describe_topics(topics)
        return [
            TopicPartition(d["topic"], p["partition"])
            for d in described
            if not d.get("error_code")
            for p in sorted(d["partitions"], key=lambda p: p["partition"])
        ]

    async def _ends(self, tps: list[TopicPartition]) -> tuple[dict[Partition, int], ...]:
        consumer = self._consumer
        assert consumer is not None
        listed = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, max(listed[tp] - 1, starts[tp]))
        ends = {(tp.topic, tp.partition): int(listed[tp]) for tp in tps}
        pending = {tp for tp in tps if listed[tp] > starts[tp]}
        deadline = time.monotonic() + 5
        while pending and time.monotonic() < deadline:
            await consumer.getmany(*pending, timeout_ms=500, max_records=1)
            for tp in list(pending):
                high = consumer.highwater(tp)
                if high is not None:
                    ends[(tp.topic, tp.partition)] = max(int(high), int(listed[tp]))
                    pending.discard(tp)
        return ends, {(tp.topic, tp.partition): int(starts[tp]) for tp in tps}

    async def _group(self, group: str, tps: list[TopicPartition]) -> GroupView:
        admin = self._admin
        assert admin is not None
        offsets = await admin.list_consumer_group_offsets(group, partitions=tps)
        committed: dict[Partition, int | None] = {(tp.topic, tp.partition): None for tp in tps}
        for tp, meta in offsets.items():
            if meta is not None and meta.offset >= 0:
                committed[(tp.topic, tp.partition)] = int(meta.offset)
        members: int | None = None  # unknown is not zero: no alert on a failed question
        with contextlib.suppress(KafkaError, IndexError, ValueError):
            (response,) = await admin.describe_consumer_groups([group])
            members = sum(len(g[-1]) for g in response.groups if g[1] == group)
        return GroupView(members, committed)

    async def scrape(self) -> Snapshot:
        tps = await self._partitions()
        ends, starts = await self._ends(tps)
        groups = {}
        for group, topic in self.groups.items():
            own = [tp for tp in tps if tp.topic == topic]
            groups[group] = await self._group(group, own)
        return Snapshot(ends, starts, groups)

    def publish(self, snapshot: Snapshot) -> None:
        """Replace every series with this snapshot's (no await between: a scrape of
        /metrics never sees half of it)."""
        m = self.metrics
        for gauge in (m.partition_offset, m.group_offset, m.lag, m.lag_sum, m.members):
            gauge.clear()
        for (topic, partition), end in snapshot.ends.items():
            m.partition_offset.labels(topic, str(partition)).set(end)
        for group, view in snapshot.groups.items():
            if view.members is not None:
                m.members.labels(group).set(view.members)
            totals: dict[str, int] = {}
            for (topic, partition), lag in snapshot.lag(group).items():
                m.lag.labels(group, topic, str(partition)).set(lag)
                totals[topic] = totals.get(topic, 0) + lag
                offset = view.committed[(topic, partition)]
                if offset is not None:
                    m.group_offset.labels(group, topic, str(partition)).set(offset)
            for topic, total in totals.items():
                m.lag_sum.labels(group, topic).set(total)
        m.last_success.set(time.time())
        self.last_success = time.monotonic()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.publish(await self.scrape())
            except (KafkaError, OSError, TimeoutError) as exc:
                self.metrics.errors.inc()
                log.warning(
                    "could not read the groups' offsets from the broker; retrying",
                    extra={"action": "lag_scrape_failed", "error": repr(exc)},
                )
            self.metrics.scrape_seconds.observe(time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    def fresh(self) -> bool:
        """Scraped within the last three intervals: what /readyz reports."""
        return time.monotonic() - self.last_success < 3 * self.interval_s + 10


async def run_lag_exporter(
    settings: Settings,
    bootstrap: str,
    stop: asyncio.Event,
    *,
    port: int,
    interval_s: float = 15.0,
    metrics: ExporterMetrics | None = None,
    listening: asyncio.Future[int] | None = None,
) -> None:
    """Serve /metrics, /healthz and /readyz on ``port`` and export the ALMA groups'
    lag every ``interval_s`` until ``stop`` is set; ``listening`` gets the port."""
    metrics = metrics or ExporterMetrics()
    health = http.Health(waiting={"kafka": f"connecting to {bootstrap}"})
    async with http.serve(port, metrics.registry, health) as bound:
        if listening is not None:
            listening.set_result(bound)
        exporter = LagExporter(
            bootstrap,
            alma_groups(settings),
            metrics,
            client_options=kafka.client_options(settings),
            interval_s=interval_s,
        )
        attempt = 0
        while not stop.is_set():
            try:
                async with exporter:
                    del health.waiting["kafka"]

                    async def scraped() -> bool:
                        return exporter.fresh()

                    health.checks["kafka"] = scraped
                    await exporter.run(stop)
                    return
            except (KafkaError, OSError) as exc:
                attempt += 1
                health.waiting["kafka"] = f"unreachable (attempt {attempt}): {exc!r}"
                log.warning(
                    "Kafka unreachable; retrying",
                    extra={"action": "kafka_retry", "attempt": attempt, "error": repr(exc)},
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), min(2.0 * attempt, 10.0))
