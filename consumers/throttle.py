"""Rate quotas at the consumer (ALMA_TENANT_TOPICS): before a batch is handled, each
tenant's records are admitted by its bucket (:class:`alma_core.quotas.TenantGate`); what
is not admitted is put back (each partition sought to its first record not admitted,
so nothing is dropped and each run's order is kept) and every partition of the tenant
held here is paused (:attr:`Assignment.throttled`) until its bucket refills a chunk.
Meanwhile the fetches bring the other tenants' records only: one tenant's backlog never
waits in front of another's."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from alma_core import errors
from alma_core.consumers.assignment import Assignment
from alma_core.consumers.metrics import Metrics
from alma_core.quotas import Quota, TenantGate
from alma_core.storage.tenant_settings import REFRESH_S
from alma_core.tenancy import TenantTopics

log = logging.getLogger("alma.consumers")


Load = Callable[[], Awaitable[dict[str, Quota]]]  # every tenant's own quota


class Throttle:
    def __init__(
        self,
        gate: TenantGate,
        topics: TenantTopics,
        metrics: Metrics,
        load: Load | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.gate = gate
        self.topics = topics
        self.metrics = metrics
        self.load = load
        self.refresh_s = refresh_s
        self._loaded_at: float | None = None

    async def refresh(self, now: float) -> None:
        """Read the tenants' own quotas again (``alma tenants set``) once ``refresh_s``
        has passed; PostgreSQL being away keeps the quotas it has (logged, never raised)."""
        if self.load is None or (
            self._loaded_at is not None and now - self._loaded_at < self.refresh_s
        ):
            return
        self._loaded_at = now
        try:
            quotas = await self.load()
        except (errors.StorageError, OSError, asyncpg.PostgresError) as exc:
            log.warning(
                "tenants' quotas not read; the ones read before stay",
                extra={"action": "tenant_settings_unread", "error": repr(exc)},
            )
            return
        self.gate.configure(self.gate.default, quotas)

    def _share(self, consumer: AIOKafkaConsumer, topic: str) -> float:
        """The part of ``topic``'s partitions this member holds."""
        held = sum(1 for tp in consumer.assignment() if tp.topic == topic)
        total = len(consumer.partitions_for_topic(topic) or ()) or held or 1
        return held / total

    def admit(
        self,
        consumer: AIOKafkaConsumer,
        a: Assignment,
        batch: dict[TopicPartition, list[Any]],
        now: float,
    ) -> dict[TopicPartition, list[Any]]:
        """``batch`` less what its tenants' quotas do not admit now (put back)."""
        by_topic: dict[str, list[TopicPartition]] = defaultdict(list)
        for tp in batch:
            by_topic[tp.topic].append(tp)
        throttled = False
        for topic, tps in by_topic.items():
            tenant = self.topics.tenant_of(topic)
            if tenant is None:
                continue
            wanted = sum(len(batch[tp]) for tp in tps)
            left = self.gate.admit(tenant, wanted, self._share(consumer, topic), now)
            if left:
                self.metrics.tenant_events.labels(tenant).inc(left)
            if left == wanted:
                continue
            for tp in sorted(tps, key=lambda tp: tp.partition):
                records = batch[tp]
                if left >= len(records):
                    left -= len(records)
                    continue
                consumer.seek(tp, records[left].offset)  # put back: fetched again later
                if left:
                    batch[tp] = records[:left]
                else:
                    del batch[tp]
                left = 0
            held = {tp for tp in consumer.assignment() if tp.topic == topic}
            if not held <= a.throttled:
                self.metrics.tenant_throttled.labels(tenant).inc()
                log.info(
                    "tenant over its rate quota: its partitions wait",
                    extra={"action": "tenant_throttled", "tenant_id": tenant},
                )
            a.throttled |= held
            throttled = True
        if throttled:
            a.sync_pauses(consumer)
        return batch

    def release(self, consumer: AIOKafkaConsumer, a: Assignment, now: float) -> float | None:
        """Let in again the throttled tenants whose bucket refilled; the seconds until the
        next one may be (None: none is throttled)."""
        if not a.throttled:
            return None
        soonest: float | None = None
        for topic in {tp.topic for tp in a.throttled}:
            tenant = self.topics.tenant_of(topic)
            wait = (
                0.0
                if tenant is None
                else self.gate.wait_s(tenant, self._share(consumer, topic), now)
            )
            if wait <= 0:
                a.throttled = {tp for tp in a.throttled if tp.topic != topic}
            else:
                soonest = wait if soonest is None else min(soonest, wait)
        a.sync_pauses(consumer)
        return soonest
