"""Tracing: W3C trace context carried in Kafka headers, and the spans of one event.

Off unless configured (docs/operations.md, "Traces"): with no tracer provider the SDK
side sends no header and the workers make no span, so an untraced deployment pays one
boolean test per batch (``python -m bench --only tracing`` has the figures).

* **The orchestrator's side** (the SDK, the Temporal plugin, the LangGraph saver): when
  the application has set a tracer provider, each published event gets a ``publish``
  span, a child of the caller's current span, and its context in the record's
  ``traceparent`` (and ``tracestate``) header; a join's reply read back is a span too.
* **The workers** (:func:`configure`, from the standard ``OTEL_*`` variables) continue
  that context: one span per event, a child of the publisher's, linked to the span of
  the batch that carried it (the batch's span is not nested under up to 500 parents);
  the records the event leads to (hand-offs, replies) carry the event span's context
  on. A record without a context starts its own trace.

Span attributes name the tenant, workflow, run, node, branch, event id and seq, never
any state or payload content. Only ``opentelemetry-api`` is imported here; the SDK
and the exporter are the ``tracing`` extra, imported by :func:`configure` alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from alma_core import errors

NAME = "alma_stream"
HEADERS = ("traceparent", "tracestate")
"""The W3C trace context headers: what a derived record copies from its source."""

_PROPAGATOR = TraceContextTextMapPropagator()
_configured: list[Any] = []  # the worker's SDK provider, once configured

log = logging.getLogger("alma.tracing")


def active() -> bool:
    """Whether spans are recorded in this process: an application (or :func:`configure`)
    has set a tracer provider. Cheap: the SDK side asks once per publish."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


_tracer: list[tuple[trace.TracerProvider, Tracer]] = []  # get_tracer builds one per call


def tracer() -> Tracer:
    """Our tracer, of the provider set now (kept: the SDK builds a new one per call)."""
    provider = trace.get_tracer_provider()
    if not _tracer or _tracer[0][0] is not provider:
        _tracer[:] = [(provider, provider.get_tracer(NAME))]
    return _tracer[0][1]


def configure(service: str, *, exporter: str, protocol: str | None = None) -> bool:
    """Install the OpenTelemetry SDK's tracer provider for a worker process, configured
    the standard way: ``exporter`` is ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``
    or ``none``), and the SDK reads the rest itself (``OTEL_EXPORTER_OTLP_ENDPOINT``,
    ``OTEL_TRACES_SAMPLER`` and ``_ARG``, ``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*``). ``service`` names the process when
    ``OTEL_SERVICE_NAME`` does not. Whether tracing is on."""
    if exporter == "none":
        return False
    if active():
        return True  # the application's own provider (a worker embedded in a test, say)
    if protocol not in (None, "http/protobuf"):
        raise errors.ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported: ALMA Stream exports "
            "OTLP over HTTP. What to do: set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf and "
            "point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's HTTP port (4318)"
        )
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        raise errors.ConfigError(
            f"OTEL_TRACES_EXPORTER={exporter} asks for traces, but the OpenTelemetry SDK "
            "is not installed. What to do: pip install 'alma-stream[tracing]', or unset "
            "OTEL_TRACES_EXPORTER"
        ) from None
    span_exporter: SpanExporter
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()
    else:
        raise errors.ConfigError(
            f"OTEL_TRACES_EXPORTER={exporter} is not supported. What to do: use otlp "
            "(an OpenTelemetry Collector, Jaeger, Tempo...), console or none"
        )
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service}))
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    _configured.append(provider)
    log.info(
        "traces exported",
        extra={
            "action": "tracing_on",
            "exporter": exporter,
            "service": resource.attributes.get("service.name"),
        },
    )
    return True


def shutdown() -> None:
    """Export what is buffered and stop the worker's provider (at a clean stop; a
    killed process loses at most ``OTEL_BSP_SCHEDULE_DELAY`` of spans)."""
    while _configured:
        _configured.pop().shutdown()


def inject(span: Span | None = None) -> list[tuple[str, bytes]]:
    """Kafka headers carrying ``span``'s context (the current span's when None); none
    when there is no valid context."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=ctx)
    return [(k, v.encode()) for k, v in carrier.items()]


def extract(headers: Iterable[tuple[str, bytes | str | None]]) -> otel_context.Context | None:
    """The trace context a record carries, or None (no header, or an unreadable one:
    the event starts its own trace)."""
    carrier = context_pairs(headers)
    if "traceparent" not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def replace_context(
    headers: Sequence[tuple[str, bytes]], span: Span
) -> tuple[tuple[str, bytes], ...]:
    """``headers`` with their trace context replaced by ``span``'s: what a derived
    record copies is the span that made it, not the publisher's."""
    kept = tuple((k, v) for k, v in headers if k not in HEADERS)
    return kept + tuple(inject(span))


def context_pairs(headers: Iterable[tuple[str, bytes | str | None]]) -> dict[str, str]:
    """A record's trace context headers as text (none when one is unreadable), to read
    or to copy onto a record derived from it (an outbox row's headers are text)."""
    out: dict[str, str] = {}
    for k, v in headers:
        if k in HEADERS and v is not None:
            try:
                out[k] = v.decode("ascii") if isinstance(v, bytes) else v
            except UnicodeDecodeError:
                return {}
    return out


def event_attributes(event: Any) -> dict[str, Any]:
    """The identifying attributes of a lifecycle event (no state, no payload)."""
    attrs: dict[str, Any] = {
        "alma.tenant_id": event.tenant_id,
        "alma.workflow_id": event.workflow_id,
        "alma.run_id": event.run_id,
        "alma.event_id": event.event_id,
        "alma.event_type": str(event.type),
    }
    if event.node_id:
        attrs["alma.node_id"] = event.node_id
    if event.branch_id:
        attrs["alma.branch_id"] = event.branch_id
    return attrs


def link(span: Span) -> list[Link]:
    return [Link(span.get_span_context())]


def start(
    name: str,
    *,
    parent: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[Link] = (),
) -> Span:
    """A started span (the caller ends it), a child of ``parent``; a root of its own
    trace when ``parent`` is None (a record that carried no context)."""
    return tracer().start_span(
        name,
        context=parent if parent is not None else otel_context.Context(),
        kind=kind,
        attributes=attributes,
        links=links,
    )


def caller_span(
    name: str, *, kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None
) -> contextlib.AbstractContextManager[Span | None]:
    """The SDK's span of a call (a child of the caller's current span, and current for
    what the call does), or nothing when the application set no tracer provider."""
    if not active():
        return contextlib.nullcontext()
    return tracer().start_as_current_span(name, kind=kind, attributes=attributes)


def exemplar() -> dict[str, str] | None:
    """The current trace's id as a Prometheus exemplar (a slow bucket leads to its
    trace), or None when no sampled span is current."""
    ctx = trace.get_current_span().get_span_context()
    if not (ctx.is_valid and ctx.trace_flags.sampled):
        return None
    return {"trace_id": f"{ctx.trace_id:032x}"}


def current_ids(within: otel_context.Context | None = None) -> dict[str, str]:
    """The current span's trace and span ids as hex (for a log line), or nothing;
    ``within``: the span of that context instead (a record's, :func:`extract`)."""
    ctx = trace.get_current_span(within).get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}
