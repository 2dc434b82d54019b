"""The outbox relay: publishes records written in a committed transaction.

Right after a batch commits, the worker publishes that batch's outbox rows; a
sweep picks up rows left behind by a crash (older than ``sweep_age_s``).
Publishing twice is possible (a crash between send and mark) and harmless:
every reader de-duplicates (by event_id, join_id or source coordinates).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from alma_core.storage.postgres import STORAGE_FAILURES, is_storage_failure
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
    ) -> None:
        self.pool = pool
        self.producer = producer
        self.metrics = metrics
        self.kinds = kinds  # topic -> metric label (handoff, dlq, reply)
        self.sweep_age_s = sweep_age_s
        self.sweep_every_s = sweep_every_s
        self._last_sweep = 0.0

    async def publish(self, ids: list[int]) -> int:
        """Publish these rows (those not yet published), in id order."""
        if not ids:
            return 0
        return await self._publish(
            "SELECT id, topic, key, value, headers FROM outbox "
            "WHERE id = ANY($1::bigint[]) AND published_at IS NULL ORDER BY id",
            ids,
        )

    async def send_now(
        self, topic: str, key: bytes | None, value: bytes, headers: list[list[str]]
    ) -> bool:
        """Send one record outside the outbox (the last resort for a dead letter that
        could not be stored); False when Kafka refused it."""
        try:
            await self.producer.send_and_wait(
                topic, value, key=key, headers=[(str(k), str(v).encode()) for k, v in headers]
            )
        except KafkaError as exc:
            log.error(
                "sending a record to %s failed", topic,
                extra={"action": "send_failed", "topic": topic, "error": repr(exc)},
            )  # fmt: skip
            return False
        return True

    async def sweep(self, *, force: bool = False) -> int:
        """Publish rows a crashed worker left behind; prune old published rows."""
        now = time.monotonic()
        if not force and now - self._last_sweep < self.sweep_every_s:
            return 0
        self._last_sweep = now
        sent = await self._publish(
            "SELECT id, topic, key, value, headers FROM outbox WHERE published_at IS NULL "
            "AND created_at < now() - make_interval(secs => $1) ORDER BY id LIMIT 1000",
            0.0 if force else self.sweep_age_s,
        )
        with contextlib.suppress(*STORAGE_FAILURES):
            await self.pool.execute(
                "DELETE FROM outbox WHERE published_at < now() - interval '1 hour'"
            )
        return sent

    async def _publish(self, sql: str, arg: object) -> int:
        try:
            rows = await self.pool.fetch(sql, arg)
            if not rows:
                return 0
            futures = [
                await self.producer.send(
                    r["topic"],
                    r["value"],
                    key=r["key"],
                    headers=[(k, v.encode()) for k, v in _pairs(r["headers"])],
                )
                for r in rows
            ]
            for future in futures:
                await future
            await self.pool.execute(
                "UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[])",
                [r["id"] for r in rows],
            )
        except Exception as exc:
            if not (isinstance(exc, KafkaError) or is_storage_failure(exc)):
                raise
            self.metrics.outbox_failures.inc()
            log.warning(
                "outbox publish failed; the sweep will retry",
                extra={"action": "outbox_failed", "error": repr(exc)},
            )
            return 0
        for r in rows:
            self.metrics.outbox_published.labels(self.kinds.get(r["topic"], "other")).inc()
        return len(rows)


def _pairs(headers: object) -> list[tuple[str, str]]:
    data: Any = json.loads(headers) if isinstance(headers, str) else headers
    return [(str(k), str(v)) for k, v in (data or [])]
