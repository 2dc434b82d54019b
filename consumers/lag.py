"""Consumer lag from the broker's view of each group: ``alma lag-exporter``.

A worker's own ``alma_consumer_lag`` is computed inside the consumer after each
batch, so a group that died or hangs shows a frozen lag, or none, and an alert or
an autoscaler reading it stays quiet. This process asks the broker instead, every
few seconds: the offsets each ALMA group committed (Kafka's group offsets, which the
runtime commits after its PostgreSQL commit) against where each partition ends,
and how many members each group has. It exports them under kafka_exporter's metric
names, so dashboards, alerts and autoscalers work the same with either exporter.

What the broker says comes from :class:`~alma_core.messaging.broker_view.BrokerView`
(as for ``alma offsets reset``): a partition ends at the high watermark of a fetch of
its last batch, exact on every broker (the embedded one answers ListOffsets with the
start of its last batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from alma_core import errors
from alma_core.consumers import http
from alma_core.consumers.metrics import ExporterMetrics
from alma_core.messaging import kafka
from alma_core.messaging.broker_view import BrokerView
from alma_core.settings import Settings

log = logging.getLogger("alma.lag")

Partition = tuple[str, int]  # topic, partition


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
        patterns: dict[str, str] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.groups = groups
        # a group that reads every topic matching a pattern instead (ALMA_TENANT_TOPICS:
        # the checkpointer, each tenant's lifecycle topic), listed at every scrape
        self.patterns = patterns or {}
        self.metrics = metrics
        self.options = client_options or {}
        self.interval_s = interval_s
        self.last_success = 0.0  # monotonic
        self._view: BrokerView | None = None

    async def __aenter__(self) -> LagExporter:
        self._view = await BrokerView(self.bootstrap, self.options).__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._view is not None:
            await self._view.close()
            self._view = None

    async def scrape(self) -> Snapshot:
        view = self._view
        assert view is not None
        ends: dict[Partition, int] = {}
        starts: dict[Partition, int] = {}
        partitions: dict[str, list[int]] = {}
        read = {group: [topic] for group, topic in self.groups.items()}
        if self.patterns:
            listed = await view.topics()
            for group, pattern in self.patterns.items():
                read[group] = [t for t in listed if re.fullmatch(pattern, t)]
        for topic in sorted({t for topics in read.values() for t in topics}):
            partitions[topic] = await view.partitions(topic)
            for partition, log in (await view.logs(topic, partitions[topic])).items():
                ends[(topic, partition)] = log.end
                starts[(topic, partition)] = log.start
        groups = {}
        for group, topics in read.items():
            offsets: dict[Partition, int | None] = {}
            for topic in topics:
                committed = await view.committed(group, topic, partitions[topic])
                offsets.update({(topic, p): offset for p, offset in committed.items()})
            members: int | None = None  # unknown is not zero: no alert on a failed question
            with contextlib.suppress(KafkaError, IndexError, ValueError):
                members = len(await view.members(group))
            groups[group] = GroupView(members, offsets)
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
            except (KafkaError, OSError, TimeoutError, errors.AlmaError) as exc:
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
    async with http.serve(port, metrics.registry, health, settings.metrics_host) as bound:
        if listening is not None:
            listening.set_result(bound)
        exporter = LagExporter(
            bootstrap,
            settings.consumer_groups(),
            metrics,
            client_options=kafka.client_options(settings),
            interval_s=interval_s,
            patterns=settings.consumer_group_patterns(),
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
