"""Trace context in Kafka headers, the settings that turn traces on, and log lines that
carry the current trace (alma_core.tracing, alma_core.logs); the spans the workers
export are followed end to end in tests/integration/test_tracing.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from alma_core import errors, logs, tracing
from alma_core.settings import Settings, load

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def provider() -> Iterator[InMemorySpanExporter]:
    """A tracer provider for the test alone (OpenTelemetry sets one per process; reset
    after, as its own tests do)."""
    exporter = InMemorySpanExporter()
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(p)
    try:
        yield exporter
    finally:
        trace._TRACER_PROVIDER = None
        trace._TRACER_PROVIDER_SET_ONCE = Once()


def test_off_without_a_provider_no_header_and_no_ids() -> None:
    assert not tracing.active()
    with tracing.caller_span("publish node.completed") as span:
        assert span is None
        assert tracing.inject() == []  # an untraced publish sends no trace header
    assert tracing.current_ids() == {}
    assert tracing.exemplar() is None


def test_a_record_context_read_and_carried_on(provider: InMemorySpanExporter) -> None:
    parent = tracing.extract([("alma.join_id", b"j1"), ("traceparent", TRACEPARENT.encode())])
    assert parent is not None
    span = tracing.start("checkpointer node.completed", parent=parent)
    ctx = span.get_span_context()
    assert f"{ctx.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"  # the publisher's trace
    headers = tracing.replace_context(
        (("alma.join_id", b"j1"), ("traceparent", TRACEPARENT.encode())), span
    )
    assert headers[0] == ("alma.join_id", b"j1")
    carried = dict(headers)["traceparent"].decode()
    assert (
        carried == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    )  # the span's, not the parent's
    assert tracing.context_pairs(headers) == {"traceparent": carried}
    span.end()
    (exported,) = provider.get_finished_spans()
    assert exported.parent is not None
    assert f"{exported.parent.span_id:016x}" == "b7ad6b7169203331"


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("traceparent", b"garbage")],
        [("traceparent", b"00-00000000000000000000000000000000-b7ad6b7169203331-01")],
        [("traceparent", b"\xff\xfe")],
        [("tracestate", b"a=b")],
    ],
)
def test_a_record_without_a_readable_context_starts_its_own_trace(
    headers: list[tuple[str, bytes]],
) -> None:
    assert tracing.extract(headers) is None


def test_the_sdk_span_is_a_child_of_the_callers_and_its_context_is_sent(
    provider: InMemorySpanExporter,
) -> None:
    tracer = trace.get_tracer("app")
    with (
        tracer.start_as_current_span("orchestrate") as root,
        tracing.caller_span("publish node.completed") as span,
    ):
        assert span is not None
        sent = dict(tracing.inject())["traceparent"].decode()
        assert tracing.current_ids()["span_id"] in sent
        assert tracing.exemplar() == {"trace_id": f"{root.get_span_context().trace_id:032x}"}
    publish, _ = provider.get_finished_spans()
    assert publish.parent is not None
    assert publish.parent.span_id == root.get_span_context().span_id


def test_log_lines_carry_the_current_trace(provider: InMemorySpanExporter) -> None:
    record = logging.LogRecord("alma", logging.WARNING, __file__, 1, "dead letter", None, None)
    with trace.get_tracer("app").start_as_current_span("batch") as span:
        logs.TraceIds().filter(record)
    doc = json.loads(logs.JsonFormatter().format(record))
    assert doc["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert doc["span_id"] == f"{span.get_span_context().span_id:016x}"
    outside = logging.LogRecord("alma", logging.INFO, __file__, 1, "idle", None, None)
    logs.TraceIds().filter(outside)
    assert "trace_id" not in json.loads(logs.JsonFormatter().format(outside))


def test_traces_on_by_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert Settings().traces_exporter == "none"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert Settings().traces_exporter == "otlp"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert Settings().traces_exporter == "console"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Settings().traces_exporter == "none"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in Settings().to_env()  # inherited, not passed
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with pytest.raises(errors.ConfigError, match=r"OTEL_TRACES_EXPORTER='jaeger'"):
        load()


def test_an_exporter_that_cannot_be_used_is_refused_with_what_to_do() -> None:
    assert tracing.configure("alma-checkpointer", exporter="none") is False
    with pytest.raises(errors.ConfigError, match="http/protobuf"):
        tracing.configure("alma-checkpointer", exporter="otlp", protocol="grpc")
    assert not tracing.active()


def test_alma_up_says_whether_and_where_traces_go() -> None:
    from alma_core.cli.stack import traces_line

    assert traces_line(Settings()).startswith("traces: off")
    endpoint = Settings(otel_exporter_otlp_endpoint="http://collector:4318")
    assert traces_line(endpoint) == "traces: on, exported over OTLP/HTTP to http://collector:4318"
    console = Settings(otel_traces_exporter="console")
    assert "printed to the workers' output" in traces_line(console)
    disabled = Settings(otel_exporter_otlp_endpoint="http://c:4318", otel_sdk_disabled=True)
    assert traces_line(disabled).startswith("traces: off")
