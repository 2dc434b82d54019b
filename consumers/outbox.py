"""The outbox relay: publishes records written in a committed transaction.

Right after a batch commits, the worker publishes that batch's outbox rows; a
sweep, every ``sweep_every_s`` whether or not records flow, picks up rows left
behind by a crash or a failed send (older than ``sweep_age_s``) and prunes rows
published long ago. Every publish first claims its rows (:mod:`alma_core.storage.outbox`):
two relays never publish one row at the same time. Publishing twice is still possible
(a crash between send and mark) and harmless: every reader de-duplicates (by
event_id, join_id or source coordinates).

A run's rows of one topic (its hand-offs, its replies: one topic and key) leave in
the order they were written: the relay sends them one after the other and stops at
the first Kafka refuses; that row keeps its place with ``attempts``, ``last_error``
and a ``next_attempt_at`` that doubles up to ``retry_max_s``, and the rows after it
wait for it. Other runs' rows, and dead letters (each complete in itself, sent on its
own), never wait for it: one bad row (a reply topic that does not exist) holds back
only what must come after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from alma_core import tracing
from alma_core.consumers.metrics import Metrics
from alma_core.storage import outbox
from alma_core.storage.postgres import STORAGE_FAILURES

log = logging.getLogger("alma.outbox")


class OutboxRelay:
    def __init__(
        self,
        pool: asyncpg.Pool,
        producer: AIOKafkaProducer,
        metrics: Metrics,
        *,
        kinds: dict[str, str],
        reply_prefix: str | None = None,
        sweep_age_s: float = 10.0,
        sweep_every_s: float = 5.0,
        retry_max_s: float = 300.0,
        lease_s: float = 60.0,
    ) -> None:
        self.pool = pool
        self.producer = producer
        self.metrics = metrics
        self.kinds = kinds  # topic -> metric label (handoff, dlq, reply)
        self.reply_prefix = reply_prefix  # ALMA_TENANT_TOPICS: each tenant's reply topic
        # dead letters go on their own; every other topic keeps each key's order
        self.unordered = [topic for topic, kind in kinds.items() if kind == "dlq"]
        self.sweep_age_s = sweep_age_s
        self.sweep_every_s = sweep_every_s
        self.retry_max_s = retry_max_s
        self.lease_s = lease_s  # longer than any publish takes: the producer's timeouts
        self.traced = tracing.active()  # the worker configures tracing before this
        self._last_sweep = 0.0

    def kind(self, topic: str) -> str:
        """What a topic's records are, as the metrics and spans name it."""
        kind = self.kinds.get(topic)
        if kind is None and self.reply_prefix and topic.startswith(self.reply_prefix):
            return "reply"
        return kind or "other"

    async def publish(self, ids: list[int]) -> int:
        """Publish these rows (a batch's, just committed), those this relay can claim."""
        if not ids:
            return 0
        return await self._publish(
            outbox.claim(self.pool, ids, self.unordered, self.lease_s), swept=False
        )

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
            outbox.claim_left_behind(
                self.pool, 0.0 if force else self.sweep_age_s, self.unordered, self.lease_s
            ),
            swept=True,
        )
        with contextlib.suppress(*STORAGE_FAILURES):
            await outbox.prune(self.pool)
        return sent

    async def _publish(self, claiming: Awaitable[list[asyncpg.Record]], *, swept: bool) -> int:
        """Send the claimed rows: each key's rows of an ordered topic one after the
        other, up to the first refused; everything else at once. Then mark them.
        ``swept``: rows left behind (by a crash, a failed send), found by the sweep."""
        try:
            rows = await claiming
        except STORAGE_FAILURES as exc:
            return self._failed(exc, "claiming outbox rows")
        if not rows:
            return 0
        chains: dict[tuple[str, object], list[asyncpg.Record]] = {}
        for r in rows:  # in id order; a dead letter is a chain of its own
            alone = r["topic"] in self.unordered
            chains.setdefault((r["topic"], r["id"] if alone else r["key"]), []).append(r)
        outcomes = await asyncio.gather(
            *(self._send_chain(chain, swept) for chain in chains.values())
        )
        sent = [r for chain_sent, _, _ in outcomes for r in chain_sent]
        failed = [f for _, chain_failed, _ in outcomes for f in chain_failed]
        held = [r["id"] for _, _, chain_held in outcomes for r in chain_held]
        try:
            await outbox.mark_published(self.pool, [r["id"] for r in sent])
            await outbox.mark_failed(self.pool, [(r["id"], e) for r, e in failed], self.retry_max_s)
            await outbox.release(self.pool, held)
        except STORAGE_FAILURES as exc:
            self._failed(exc, "marking outbox rows")  # sent again later: readers de-duplicate
        for r in sent:
            self.metrics.outbox_published.labels(self.kind(r["topic"])).inc()
        for r, error in failed:
            self.metrics.outbox_failures.inc()
            log.warning(
                "outbox row not published; it is retried later, and the rows of its run on "
                "this topic wait for it",
                extra={
                    "action": "outbox_failed",
                    "outbox_id": r["id"],
                    "topic": r["topic"],
                    "held_back": sum(1 for h in held if h > r["id"]),
                    "error": error[:300],
                },
            )
        return len(sent)

    async def _send_chain(
        self, chain: list[asyncpg.Record], swept: bool
    ) -> tuple[list[asyncpg.Record], list[tuple[asyncpg.Record, str]], list[asyncpg.Record]]:
        """Send rows in order, each once the one before it is acknowledged; at the first
        refused, stop: (sent, [(refused, error)], held back)."""
        for i, r in enumerate(chain):
            headers = [(k, v.encode()) for k, v in outbox.header_pairs(r["headers"])]
            span = self._span(r, headers, swept) if self.traced else None
            if span is not None:
                headers = list(tracing.replace_context(headers, span))
            try:
                await self.producer.send_and_wait(
                    r["topic"], r["value"], key=r["key"], headers=headers
                )
            except KafkaError as exc:
                if span is not None:
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                    span.end()
                return chain[:i], [(r, repr(exc))], chain[i + 1 :]
            if span is not None:
                span.end()
        return chain, [], []

    def _span(
        self, row: asyncpg.Record, headers: list[tuple[str, bytes]], swept: bool
    ) -> Span | None:
        """The send of a row whose source event was traced: a child of that event's span,
        and the context the record carries on (the reply's, back to the orchestrator)."""
        parent = tracing.extract(headers)
        if parent is None:
            return None
        kind = self.kind(row["topic"])
        return tracing.start(
            f"outbox send {kind}",
            parent=parent,
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.destination.name": row["topic"],
                "alma.outbox.id": row["id"],
                # left behind by a crash (or a failed send) and sent by the sweep
                "alma.outbox.swept": swept,
            },
        )

    def _failed(self, exc: BaseException, doing: str) -> int:
        self.metrics.outbox_failures.inc()
        log.warning(
            "outbox: PostgreSQL failed while %s; the sweep will retry",
            doing,
            extra={"action": "outbox_failed", "error": repr(exc)},
        )
        return 0
