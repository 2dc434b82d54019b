"""Publishing lifecycle events: :class:`Publisher` checks each event against the
contract before anything is sent (:meth:`Publisher.event`), and sends it keyed by its
run id with acknowledgement from all in-sync replicas, so one caller's events of a run
keep their order."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from opentelemetry.trace import SpanKind
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from alma_core import errors, history, tenancy, tracing
from alma_core import settings as settings_mod
from alma_core.logs import redact
from alma_core.messaging import acls, kafka
from alma_core.schemas.events import EVENT_MODELS, Event, EventType, encode
from alma_core.settings import Settings
from alma_core.storage.effects import EffectListener
from alma_core.types import WorkflowContext

Wait = Literal["published", "applied"]
"""How long a publish waits: until the broker has the event (``published``), or until
the checkpointer has had its effect too (``applied``: read-your-writes)."""


class Publisher:
    def __init__(self, settings: Settings, *, bootstrap: str | None = None) -> None:
        self.settings = settings
        self.topics = settings.topic_names  # per tenant with ALMA_TENANT_TOPICS
        chosen = bootstrap or settings.kafka_bootstrap
        if not chosen:
            raise errors.ConfigError(no_bootstrap(settings))
        self.bootstrap: str = chosen
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise errors.ConfigError(
                "AlmaClient is built inside the event loop that uses it (async with "
                "AlmaClient(...)); from synchronous code, use asyncio.run(...), or for "
                "LangGraph's graph.invoke, AlmaSaver.from_settings_sync(...)"
            ) from None
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            **kafka.producer_options(settings),
            # no linger: a caller waits for each send, and sends from many tasks batch
            # anyway while one request is in flight (aiokafka sends one at a time to a
            # broker). Apache Kafka, 2 cores: one caller's send 2.2-2.5 -> 0.9-1.0 ms
            # p50 warm (linger_ms=1 before); 50 callers at once 5,900-6,800 -> 8,800-9,000/s
            linger_ms=0,
            max_request_size=settings.max_record_bytes + 64 * 1024,
        )

    async def start(self) -> None:
        """Connect the producer; one that cannot is closed again (nothing left open) and
        the error says where it dialled and what to do."""
        try:
            await self._producer.start()
        except BaseException as exc:
            await self._producer.stop()
            if isinstance(exc, acls.REFUSALS):  # an idempotent producer's id: WRITE on a topic
                name = self.settings.lifecycle_topic
                if self.settings.tenant_topics:  # whichever tenant's this principal is
                    name = tenancy.tenant_topic(name, "<tenant>")
                topic = acls.Acl("WRITE", "topic", name)
                raise acls.denied(acls.principal(self.settings), topic, exc) from exc
            if isinstance(exc, KafkaError):
                raise errors.BrokerUnavailable(
                    f"AlmaClient cannot reach Kafka at {redact(self.bootstrap)}: {exc!r}. "
                    "What to do: check ALMA_KAFKA_BOOTSTRAP and that the broker runs, or "
                    "start `alma up` and build the client from load_running()"
                ) from exc
            raise

    async def stop(self) -> None:
        await self._producer.stop()

    def event(
        self,
        type_: str,
        ctx: WorkflowContext,
        payload: dict[str, Any],
        *,
        event_id: str | None = None,
    ) -> Event:
        """A contract event for ``ctx``, checked before anything is sent (a bad context or
        payload raises ContextError). ``event_id`` makes it idempotent: an orchestrator
        that derives it from its own identity of the step (Temporal's activity id, say)
        can publish again after a crash and the event has its effect once."""
        ctx.validate(require_tenant=self.settings.require_tenant)
        if not (ctx.tenant_id and ctx.workflow_id and ctx.run_id):
            raise errors.ContextError(f"{type_} needs tenant_id, workflow_id and run_id")
        if type_.startswith("node.") and not ctx.node_id:
            raise errors.ContextError(f"{type_} needs node_id")
        base = self.settings.lifecycle_topic if self.settings.tenant_topics else None
        if problem := tenancy.tenant_problem(ctx.tenant_id, base):
            raise errors.ContextError(f"{problem}; choose a tenant id that can")
        doc = {
            "event_id": event_id or uuid.uuid4().hex,
            "type": type_,
            "emitted_at": datetime.now(UTC),
            "tenant_id": ctx.tenant_id,
            "workflow_id": ctx.workflow_id,
            "workflow_version": ctx.workflow_version,
            "run_id": ctx.run_id,
            "node_id": ctx.node_id,
            "branch_id": ctx.branch_id,
            "payload": {k: v for k, v in payload.items() if v is not None},
        }
        try:
            return EVENT_MODELS[EventType(type_)].model_validate(doc, strict=False)  # type: ignore[return-value]
        except ValidationError as exc:
            raise errors.ContextError(f"invalid {type_}: {exc.errors()[0]['msg']}") from None

    async def send(self, event: Event, *, watch: EffectListener | None = None) -> str:
        """Send one event and wait for the broker's acknowledgement; its event_id.
        ``watch``: a waiter's listener, told of the event before it is sent, so a wait
        for its effect needs no read before it sleeps."""
        try:
            record = encode(event)
        except PydanticSerializationError:
            where = history.lone_surrogate(event.payload.model_dump())
            if where is None:
                raise
            raise errors.ContextError(
                f"{event.type} {event.event_id} of run {event.run_id!r} cannot be sent: the "
                f"text at {where or '/'} of its payload holds a lone surrogate (half of a "
                "UTF-16 pair), which UTF-8, and so the event's JSON, cannot carry; decode "
                "that text with errors='replace' (or drop the character) before sending"
            ) from None
        if len(record) > self.settings.max_record_bytes:
            raise errors.RecordTooLarge(
                f"{event.type} {event.event_id} of run {event.run_id!r} is {len(record):,} "
                f"bytes, over ALMA_MAX_RECORD_BYTES={self.settings.max_record_bytes:,}: keep "
                "large values out of the state (an artifact reference), or raise the limit "
                "on the broker's topic and in ALMA_MAX_RECORD_BYTES alike"
            )
        if watch is not None and event.tenant_id:
            watch.expect(event.event_id, event.tenant_id, event.run_id)
        try:
            topic = self.topics.lifecycle_for(event.tenant_id)
            if not tracing.active():
                await self._send(record, event.run_id.encode(), topic=topic)
            else:
                with tracing.caller_span(
                    f"publish {event.type}",
                    kind=SpanKind.PRODUCER,
                    attributes=tracing.event_attributes(event),
                ):
                    await self._send(record, event.run_id.encode(), tracing.inject(), topic=topic)
        except BaseException:
            if watch is not None:
                watch.forget(event.event_id)
            raise
        return event.event_id

    async def send_record(self, topic: str, value: bytes, key: bytes | None) -> None:
        """Send one record to a lifecycle topic as it is (a dead letter sent back:
        :func:`alma_core.sdk.dead_letters.replay`); it is decoded like any other."""
        await self._send(value, key, topic=topic)

    async def _send(
        self,
        value: bytes,
        key: bytes | None,
        headers: list[tuple[str, bytes]] | None = None,
        *,
        topic: str,
    ) -> None:
        """``headers``: the publish span's trace context, when traced."""
        try:
            await self._producer.send_and_wait(topic, value, key=key, headers=headers or None)
        except acls.REFUSALS as exc:
            who = acls.principal(self.settings)
            raise acls.denied(who, acls.Acl("WRITE", "topic", topic), exc) from exc


def no_bootstrap(s: Settings) -> str:
    """Why a client has no broker, and what to do: use the running ``alma up`` (found
    from any directory) through ``load_running()``, or start one, or set the variable."""
    what = "AlmaClient needs a Kafka bootstrap (ALMA_KAFKA_BOOTSTRAP, or bootstrap=...)"
    try:
        stack = settings_mod.running(s)
    except errors.ConfigError as several:
        return f"{what}; {several.message}"
    if stack is not None:
        return (
            f"{what}: an `alma up` is running on {stack.data_dir}. What to do: build the "
            "client from load_running() (alma_core.settings), which takes its services"
        )
    return (
        f"{what} and no `alma up` is running ({settings_mod.search(s).described()}). What "
        "to do: start the embedded stack with `alma up` (in any directory) and build the "
        "client from load_running(), or set ALMA_KAFKA_BOOTSTRAP"
    )
