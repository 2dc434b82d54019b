"""The spans of a traced worker's batches (:mod:`alma_core.tracing` says what is traced
and how it is configured).

Each batch has its own span, with the transaction, the cache write and the outbox
publish as its children. Each record has a span of its own in the trace its publisher
started (a root when it carried no context), linked to the batch's span: one event's
trace shows what happened to it, and the link leads to the batch it shared. The
records an event leads to (hand-offs, replies) carry its span's context on, so the
joiner's, the learner's and the reply's spans continue the same trace.

An event's span says what came of it (``alma.outcome``: checkpointed, duplicate,
dead_letter, learned...), its seq, and ``alma.redelivery`` when its record was
delivered before (:mod:`alma_core.storage.read_marks`)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from alma_core import tracing
from alma_core.schemas.decoder import Rejection
from alma_core.storage.batches import Batch, Committed, Effects, Incoming
from alma_core.storage.offsets import PartitionKey
from alma_core.storage.read_marks import RedisReadMarks


class BatchTracer:
    """One consumer's tracing: opens each batch's spans, and keeps what it knows of
    how far each of its partitions was read before (for ``alma.redelivery``)."""

    def __init__(self, consumer: str, group: str, marks: RedisReadMarks | None) -> None:
        self.consumer = consumer
        self.group = group
        self.marks = marks
        self.read_to: dict[PartitionKey, int] = {}  # partition -> next offset read before

    async def assigned(self, partitions: list[PartitionKey]) -> None:
        """Partitions newly assigned here: how far any member read them before."""
        if self.marks is None:
            return
        loaded = await self.marks.load(partitions)
        if loaded is None:  # Redis did not answer: unknown (what this member knew of an
            for tp in partitions:  # earlier assignment is stale), alma.redelivery left out
                self.read_to.pop(tp, None)
            return
        for tp in partitions:  # no mark: no member read past the committed offset
            self.read_to[tp] = max(self.read_to.get(tp, -1), loaded.get(tp, -1))

    def open(self, incoming: Batch) -> BatchSpans:
        return BatchSpans(self, incoming)


class BatchSpans:
    """A batch's spans, opened before it is prepared; a context manager that makes the
    batch's span current and ends every span, with the error if the batch fails."""

    def __init__(self, tracer: BatchTracer, incoming: Batch) -> None:
        consumer = tracer.consumer
        self.batch = tracing.start(
            f"{consumer} batch",
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.consumer.group.name": tracer.group,
                "messaging.batch.message_count": sum(len(rs) for rs in incoming.values()),
                "alma.consumer": consumer,
            },
        )
        links = tracing.link(self.batch)
        self.events: dict[str, Span] = {}  # by event id
        self._outcome_unknown: set[str] = set()  # until an effects' span_attributes says
        self.spans: list[Span] = []
        self.incoming: Batch = {}
        read_to: dict[PartitionKey, int] = {}
        for tp, records in incoming.items():
            known = tracer.read_to.get(tp)  # None: how far it was read is unknown
            before = -1 if known is None else known
            rewritten = []
            for r in records:
                parent = tracing.extract(r.headers)
                span = tracing.start(
                    name_of(consumer, r.decoded), parent=parent, kind=SpanKind.CONSUMER, links=links
                )
                if not span.is_recording():
                    # not sampled: its context goes on (downstream decides alike), but
                    # when the record carried one, that is as good and costs nothing
                    rewritten.append(r if parent is not None else with_context(r, span))
                    continue
                attrs = attributes_of(r)
                if known is not None:
                    attrs["alma.redelivery"] = r.offset < before
                span.set_attributes(attrs)
                self.spans.append(span)
                if event_id := attrs.get("alma.event_id"):
                    self.events[event_id] = span
                    if not isinstance(r.decoded, Rejection):
                        self._outcome_unknown.add(event_id)
                rewritten.append(with_context(r, span))
            self.incoming[tp] = rewritten
            if records:
                read_to[tp] = records[-1].offset + 1
                tracer.read_to[tp] = max(before, read_to[tp])
        # marked while the batch is prepared and applied; awaited when it ends
        self._marking = asyncio.ensure_future(tracer.marks.mark(read_to)) if tracer.marks else None
        self._unlisted: str | None = None
        self._current = trace.use_span(
            self.batch, end_on_exit=False, record_exception=False, set_status_on_exception=False
        )

    def committed(self, part: Committed[Any]) -> None:
        """What each event of a committed group came to, on its span."""
        effects: Effects | None = part.effects
        if effects is None or not self.events:  # none recorded (unsampled): nothing to say
            return
        for event_id, attrs in effects.span_attributes().items():
            span = self.events.get(event_id)
            if span is not None:
                span.set_attributes(attrs)
                self._outcome_unknown.discard(event_id)
        self._unlisted = self._unlisted or type(effects).unlisted_outcome

    async def __aenter__(self) -> BatchSpans:
        self._current.__enter__()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(Exception):
            self._current.__exit__(kind, exc, tb)
        if self._marking is not None:  # long done, as a rule: it ran beside the batch
            with contextlib.suppress(Exception):
                await self._marking
        if exc is None and self._unlisted:
            for event_id in self._outcome_unknown:
                self.events[event_id].set_attribute("alma.outcome", self._unlisted)
        for span in [*self.spans, self.batch]:
            if exc is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()


def name_of(consumer: str, decoded: object) -> str:
    if isinstance(decoded, Rejection):
        return f"{consumer} rejected"
    return f"{consumer} {getattr(decoded, 'type', 'event')}"


def attributes_of(record: Incoming) -> dict[str, Any]:
    """A recorded event span's attributes: where the record was, and the event's ids
    (what its decoding found, for a rejected one)."""
    decoded = record.decoded
    attrs: dict[str, Any] = {
        "messaging.system": "kafka",
        "messaging.destination.name": record.topic,
        "messaging.destination.partition.id": str(record.partition),
        "messaging.kafka.offset": record.offset,
    }
    if isinstance(decoded, Rejection):
        attrs["alma.outcome"] = "dead_letter"
        attrs["alma.dead_letter.reason"] = str(decoded.reason)
        for key in ("tenant_id", "run_id", "event_id"):
            if value := getattr(decoded, key, None):
                attrs[f"alma.{key}"] = value
        return attrs
    return attrs | tracing.event_attributes(decoded)


def with_context(record: Incoming, span: Span) -> Incoming:
    """``record`` carrying ``span``'s context: the hand-offs and replies it leads to
    copy it (:meth:`Incoming.trace_headers`)."""
    return replace(record, headers=tracing.replace_context(record.headers, span))
