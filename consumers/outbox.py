"""The outbox relay: publishes records written in a committed transaction.

Right after a batch commits, the worker publishes that batch's outbox rows; a
sweep, every ``sweep_every_s`` whether or not records flow, picks up rows left
behind by a crash or a failed send (older than ``sweep_age_s``) and prunes rows
published long ago. Publishing twice is possible (a crash between send and mark)
and harmless: every reader de-duplicates (by event_id, join_id or source
coordinates).

Each row succeeds or fails on its own: the rows sent are marked published; a row
Kafka refuses keeps its place with ``attempts``, ``last_error`` and a
``next_attempt_at`` that doubles up to ``retry_max_s``, so one bad row (a reply
topic that does not exist) never holds back the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from alma_core.storage import outbox
from alma_core.storage.postgres import STORAGE_FAILURES
from consumers.metrics import Metrics

log = logging.getLogger("alma.outbox")


class OutboxRelay:
    def __init__(
        self,
        pool: asyncpg.Pool,
        producer: AIOKafkaProducer,
        metrics: Metrics,
        *,
        kinds: dict[str, str],
        sweep_age_s: float = 10.0,
        sweep_every_s: float = 5.0,
        retry_max_s: float = 300.0,
    ) -> None:
        self.pool = pool
        self.producer = producer
        self.metrics = metrics
        self.kinds = kinds  # topic -> metric label (handoff, dlq, reply)
        self.sweep_age_s = sweep_age_s
        self.sweep_every_s = sweep_every_s
        self.retry_max_s = retry_max_s
        self._last_sweep = 0.0

    async def publish(self, ids: list[int]) -> int:
        """Publish these rows (those not yet published), in id order."""
        if not ids:
            return 0
        return await self._publish(outbox.unpublished(self.pool, ids))

    async def send_now(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, str]]
    ) -> bool:
        """Send one record outside the outbox (the last resort for a dead letter that
        could not be stored); False when Kafka refused it."""
        try:
            await self.producer.send_and_wait(
                topic, value, key=key, headers=[(k, v.encode()) for k, v in headers]
            )
        except KafkaError as exc:
            log.error(
                "sending a record to %s failed",
                topic,
                extra={"action": "send_failed", "topic": topic, "error": repr(exc)},
            )
            return False
        return True

    async def sweep(self, *, force: bool = False) -> int:
        """Publish rows a crashed worker left behind; prune old published rows."""
        now = time.monotonic()
        if not force and now - self._last_sweep < self.sweep_every_s:
            return 0
        self._last_sweep = now
        sent = await self._publish(
            outbox.left_behind(self.pool, 0.0 if force else self.sweep_age_s)
        )
        with contextlib.suppress(*STORAGE_FAILURES):
            await outbox.prune(self.pool)
        return sent

    async def _publish(self, reading: Awaitable[list[asyncpg.Record]]) -> int:
        try:
            rows = await reading
        except STORAGE_FAILURES as exc:
            return self._failed(exc, "reading the outbox")
        if not rows:
            return 0
        sent: list[asyncpg.Record] = []
        failed: list[tuple[asyncpg.Record, str]] = []
        pending = []
        for r in rows:  # queue every row; one refused never holds back the others
            try:
                pending.append(
                    (
                        r,
                        await self.producer.send(
                            r["topic"],
                            r["value"],
                            key=r["key"],
                            headers=[(k, v.encode()) for k, v in outbox.header_pairs(r["headers"])],
                        ),
                    )
                )
            except KafkaError as exc:
                failed.append((r, repr(exc)))
        for r, future in pending:
            try:
                await future
                sent.append(r)
            except KafkaError as exc:
                failed.append((r, repr(exc)))
        try:
            await outbox.mark_published(self.pool, [r["id"] for r in sent])
            await outbox.mark_failed(self.pool, [(r["id"], e) for r, e in failed], self.retry_max_s)
        except STORAGE_FAILURES as exc:
            self._failed(exc, "marking outbox rows")  # sent again later: readers de-duplicate
        for r in sent:
            self.metrics.outbox_published.labels(self.kinds.get(r["topic"], "other")).inc()
        for r, error in failed:
            self.metrics.outbox_failures.inc()
            log.warning(
                "outbox row not published; it is retried later",
                extra={
                    "action": "outbox_failed",
                    "outbox_id": r["id"],
                    "topic": r["topic"],
                    "error": error[:300],
                },
            )
        return len(sent)

    def _failed(self, exc: BaseException, doing: str) -> int:
        self.metrics.outbox_failures.inc()
        log.warning(
            "outbox: PostgreSQL failed while %s; the sweep will retry",
            doing,
            extra={"action": "outbox_failed", "error": repr(exc)},
        )
        return 0
