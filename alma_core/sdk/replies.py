"""The client's reply listener: reads the merge-reply topic (every partition, from
the end as of start-up) and resolves the future of each join it waits for.

A join is identified by ``(tenant_id, run_id, join_id)``: the reply topic is shared
by every client and every tenant, and a ``join_id`` is chosen by the caller and
unique only within its run, so a reply resolves a future only when all three match.
Replies that are not its own, or that cannot be read, are ignored; several clients
share one reply topic."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from alma_core import errors, tracing
from alma_core.messaging import acls
from alma_core.messaging.broker_view import BrokerView
from alma_core.schemas.events import MergeReply

log = logging.getLogger("alma.sdk")

JoinKey = tuple[str, str, str]  # tenant_id, run_id, join_id


class ReplyListener:
    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        fetch_max_wait_ms: int,
        client_options: dict[str, Any] | None = None,
        principal: str = "this client",
    ) -> None:
        self.bootstrap = bootstrap
        self.client_options = client_options or {}
        self.topic = topic
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._waiting: dict[JoinKey, asyncio.Future[MergeReply]] = {}
        self._lock = asyncio.Lock()
        self.principal = principal
        self._refused: errors.BrokerDenied | None = None  # the broker will not let it read

    async def expect(self, key: JoinKey) -> asyncio.Future[MergeReply]:
        """A future for the reply to join ``key`` (tenant, run, join id); call before
        publishing the join (positions are resolved first, so the reply cannot slip
        past)."""
        async with self._lock:  # concurrent merges share one listener
            if self._refused is not None:
                raise self._refused
            if self._task is None:
                await self._start()
        future: asyncio.Future[MergeReply] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        return future

    def forget(self, key: JoinKey) -> None:
        self._waiting.pop(key, None)

    def _refuse(self, refused: errors.BrokerDenied) -> None:
        """The broker will not let this client read its replies: every join waiting, and
        every join asked later, fails with what to grant."""
        log.error(refused.message, extra={"action": "reply_refused", "topic": self.topic})
        self._refused = refused
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(refused)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()

    async def _start(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            **self.client_options,
            enable_auto_commit=False,
            fetch_max_wait_ms=self.fetch_max_wait_ms,
        )
        # Asked of the broker: a consumer's metadata holds only the topics it was told
        # of (Apache Kafka answers an empty topic list with none; Tansu with all)
        try:
            async with BrokerView(self.bootstrap, self.client_options) as broker:
                partitions = await broker.partitions(self.topic)
        except errors.ConfigError:
            raise errors.ConfigError(
                f"reply topic {self.topic!r} does not exist, or {self.principal} may not "
                "DESCRIBE it: run `alma topics create`, or grant the orchestrator's ACLs "
                "(`alma topics acls --role orchestrator`)"
            ) from None
        await consumer.start()
        tps = [TopicPartition(self.topic, p) for p in partitions]
        consumer.assign(tps)
        try:
            await consumer.seek_to_end(*tps)
            for tp in tps:  # resolve positions now, before any join is sent
                await consumer.position(tp)
        except acls.REFUSALS as exc:
            await consumer.stop()
            raise acls.denied(self.principal, acls.Acl("READ", "topic", self.topic), exc) from exc
        self._consumer = consumer
        self._task = asyncio.create_task(self._listen(consumer))

    async def _listen(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            try:
                batch = await consumer.getmany(timeout_ms=500)
            except acls.REFUSALS as exc:
                self._refuse(
                    acls.denied(self.principal, acls.Acl("READ", "topic", self.topic), exc)
                )
                return
            for records in batch.values():
                for record in records:
                    join_id = dict(record.headers or []).get("alma.join_id", b"").decode()
                    if not any(key[2] == join_id for key in self._waiting):
                        continue  # someone else's reply (cheap check before parsing)
                    try:
                        reply = MergeReply.model_validate(json.loads(record.value))
                    except (ValueError, ValidationError) as exc:
                        log.warning(
                            "unreadable merge reply ignored",
                            extra={
                                "action": "reply_unreadable",
                                "join_id": join_id[:200],
                                "error": str(exc)[:300],
                            },
                        )
                        continue
                    future = self._waiting.get((reply.tenant_id, reply.run_id, reply.join_id))
                    if future is not None and not future.done():
                        future.set_result(reply)  # another tenant's or run's reply never gets here
                        if tracing.active():
                            received(record, reply)


def received(record: Any, reply: MergeReply) -> None:
    """The reply's arrival, in the trace it carries back (the joiner's span's): the
    orchestrator's trace shows the whole round trip."""
    parent = tracing.extract(record.headers or ())
    if parent is None:
        return
    tracing.start(
        "reply received",
        parent=parent,
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": "kafka",
            "messaging.destination.name": record.topic,
            "alma.tenant_id": reply.tenant_id,
            "alma.run_id": reply.run_id,
            "alma.join_id": reply.join_id,
            "alma.outcome": reply.status,
        },
    ).end()
