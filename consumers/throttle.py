"""Rate quotas at the consumer (ALMA_TENANT_TOPICS): before a batch is handled, each
tenant's records are admitted by its bucket (:class:`alma_core.quotas.TenantGate`); what
is not admitted is held here, in order (at most one poll's worth: nothing is dropped and
each run's order is kept), and every partition of the tenant held by this member is
paused (:attr:`Assignment.throttled`), so the rest of its backlog waits in the broker,
fetched when its turn comes. Meanwhile the fetches bring the other tenants' records
only: one tenant's backlog never waits in front of another's.

A held-back tenant goes on one partition at a time, in turn: aiokafka drops what it
fetched of a partition once it is paused, so each time the tenant goes on its backlog is
fetched again, and one fetch of every partition's backlog at once (up to
``fetch_max_bytes``, 50 MiB) is read while every consumer of the worker waits (30-50 ms
on Apache Kafka, every few seconds: the other tenants' events waited that long). The
next partition goes on in place of the last once that one delivered, so one that keeps
up never holds the others back; once the tenant's bucket is full again (it is not over
its quota) all its partitions go on. A new assignment drops what is held (it is read
again from the stored offsets)."""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from alma_core.consumers.assignment import Assignment
from alma_core.consumers.metrics import Metrics
from alma_core.consumers.tenant_limits import LimitsReader
from alma_core.quotas import TenantGate
from alma_core.tenancy import TenantTopics

log = logging.getLogger("alma.consumers")


class Throttle:
    def __init__(
        self,
        gate: TenantGate,
        topics: TenantTopics,
        metrics: Metrics,
        limits: LimitsReader | None = None,
    ) -> None:
        self.gate = gate
        self.topics = topics
        self.metrics = metrics
        self.limits = limits  # the tenants' own quotas, read with their other limits
        # records fetched and not admitted yet, in order, by partition (each paused)
        self.held: dict[TopicPartition, list[Any]] = {}
        self._generation = -1
        self._turn: dict[str, int] = {}  # by topic: the partition that went on last

    async def refresh(self) -> None:
        """The tenants' own quotas (``alma tenants set``) as last read: the reader reads
        them again every :data:`~alma_core.storage.tenant_settings.REFRESH_S` seconds;
        PostgreSQL being away keeps the quotas it has (logged, never raised)."""
        if self.limits is not None:
            self.gate.configure(self.gate.default, dict((await self.limits.current()).quotas))

    @staticmethod
    def _shares(consumer: AIOKafkaConsumer) -> Callable[[str], float]:
        """The part of a topic's partitions this member holds (its assignment counted
        once per call, not once per topic)."""
        held = Counter(tp.topic for tp in consumer.assignment())

        def share(topic: str) -> float:
            total = len(consumer.partitions_for_topic(topic) or ()) or held[topic] or 1
            return held[topic] / total

        return share

    def admit(
        self,
        consumer: AIOKafkaConsumer,
        a: Assignment,
        batch: dict[TopicPartition, list[Any]],
        now: float,
    ) -> dict[TopicPartition, list[Any]]:
        """``batch``, with the records held back before in front of each partition's, less
        what its tenants' buckets do not admit now: those are held here, in order, and
        their tenant's partitions paused (the broker keeps the rest of its backlog); a
        tenant with nothing held and tokens again is resumed."""
        if a.generation != self._generation:  # a new assignment is read from its offsets
            self.held.clear()
            self._turn.clear()  # and its partitions' turns start from the first
            self._generation = a.generation
        for tp, records in self.held.items():
            batch[tp] = records + batch.get(tp, [])
        self.held = {}
        by_topic: dict[str, list[TopicPartition]] = defaultdict(list)
        for tp in batch:
            by_topic[tp.topic].append(tp)
        for topic in {tp.topic for tp in a.throttled} - set(by_topic):
            by_topic[topic] = []  # throttled, nothing waiting: resumed once it has tokens
        if not by_topic:
            return batch
        changed = False
        shares = self._shares(consumer)
        for topic, tps in by_topic.items():
            tenant = self.topics.tenant_of(topic)
            if tenant is None:
                continue
            share = shares(topic)
            wanted = sum(len(batch[tp]) for tp in tps)
            waiting = any(tp.topic == topic for tp in a.throttled)  # held back: by chunks
            left = self.gate.admit(tenant, wanted, share, now, waiting=waiting) if wanted else 0
            if left:
                self.metrics.tenant_events.labels(tenant).inc(left)
            if left == wanted:
                if wanted or self.gate.wait_s(tenant, share, now) <= 0:
                    changed |= self._go_on(consumer, a, topic, tenant, share, now, wanted > 0)
                continue
            for tp in sorted(tps, key=_partition):
                records = batch.pop(tp)
                if left < len(records):
                    self.held[tp] = records[left:]  # waits here, in order
                    records = records[:left]
                if records:
                    batch[tp] = records
                left -= len(records)
            changed |= self._pause(consumer, a, topic, tenant)
        if changed:
            a.sync_pauses(consumer)
        return batch

    def _pause(self, consumer: AIOKafkaConsumer, a: Assignment, topic: str, tenant: str) -> bool:
        held = {tp for tp in consumer.assignment() if tp.topic == topic}
        if held <= a.throttled:
            return False
        self.metrics.tenant_throttled.labels(tenant).inc()
        log.info(
            "tenant over its rate quota: its events wait",
            extra={"action": "tenant_throttled", "tenant_id": tenant},
        )
        a.throttled |= held
        return True

    def _go_on(
        self,
        consumer: AIOKafkaConsumer,
        a: Assignment,
        topic: str,
        tenant: str,
        share: float,
        now: float,
        delivered: bool,
    ) -> bool:
        """Let a held-back tenant go on: every partition of ``topic`` once its bucket is
        full; else the next paused one in turn, in place of the one that went on before
        once that one ``delivered`` (all of it admitted: it caught up), never while its
        fetch is under way."""
        paused = sorted((tp for tp in a.throttled if tp.topic == topic), key=_partition)
        if not paused:
            return False
        if self.gate.full(tenant, share, now):
            a.throttled -= set(paused)
            return True
        going = {tp for tp in consumer.assignment() if tp.topic == topic} - a.throttled
        if going and not delivered:
            return False  # its fetch is under way
        last = self._turn.get(topic, -1)
        tp = next((tp for tp in paused if tp.partition > last), paused[0])
        self._turn[topic] = tp.partition
        a.throttled = (a.throttled | going) - {tp}
        return True

    def wait_ms(self, consumer: AIOKafkaConsumer, a: Assignment, now: float) -> int | None:
        """How long the next poll may wait before a throttled tenant may go on (None: no
        tenant is throttled)."""
        if not a.throttled:
            return None
        soonest: float | None = None
        shares = self._shares(consumer)
        for topic in {tp.topic for tp in a.throttled}:
            tenant = self.topics.tenant_of(topic)
            if tenant is None:
                continue
            wait = self.gate.wait_s(tenant, shares(topic), now)
            soonest = wait if soonest is None else min(soonest, wait)
        return None if soonest is None else max(10, int(soonest * 1000))


def _partition(tp: TopicPartition) -> int:
    return int(tp.partition)
