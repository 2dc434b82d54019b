"""What traces cost: the checkpointer draining a backlog with traces off, on with 1 %
of traces sampled, and on with every trace sampled; and the SDK's own cost per publish.

* The worker: one ``alma worker --consumers checkpointer`` process, as deployed,
  exporting over OTLP/HTTP to a receiver in this process (:mod:`bench.otlp`, which
  decodes every request as a collector would). The backlog's events carry a W3C
  ``traceparent`` as a traced orchestrator's would, sampled in the same share as the
  worker's sampler (``parentbased_traceidratio``); with traces off, none. The rate is
  read from 10 % to 90 % drained, as in the scaling suite.
* The SDK: the span and the header a publish adds (``tracing.caller_span`` and
  ``tracing.inject``), timed alone over many calls, without and with a tracer
  provider (spans to a batch processor whose exporter discards them).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.util._once import Once

from alma_core import tracing
from bench.env import Env, checkpoint_processes, scratch
from bench.otlp import otlp_receiver
from bench.report import Section, Stat, ratio
from bench.scaling import drain_rate, drained, publish_backlog

MODES: tuple[tuple[str, float | None], ...] = (("off", None), ("on, 1 %", 0.01), ("on, 100 %", 1.0))
RUNS = 200


def traceparent(rng: random.Random, sampled: bool) -> bytes:
    flags = "01" if sampled else "00"
    return f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-{flags}".encode()


async def drain(env: Env, ratio_: float | None, backlog: int, receiver_url: str) -> float:
    """Checkpoints per second draining ``backlog`` events (the scaling suite's way); the
    spans the worker exported are counted by the caller's receiver."""
    topic = await env.topic("trace")
    tag = uuid.uuid4().hex[:6]
    s = env.settings_for(topic, group_prefix=f"trace-{tag}")
    runs = [f"{tag}-{r}" for r in range(RUNS)]
    otel = (
        {}
        if ratio_ is None
        else {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(ratio_),
        }
    )
    rng = random.Random(7)

    def headers() -> list[tuple[str, bytes]] | None:
        if ratio_ is None:
            return None
        return [("traceparent", traceparent(rng, rng.random() < ratio_))]

    with scratch("alma-bench-tracing-") as logs:
        async with checkpoint_processes([s], logs, env=otel):
            published = await publish_backlog(env, topic, runs, backlog, headers)
            rate = await drain_rate(env, runs, backlog, published, logs)
            async with asyncpg.create_pool(
                env.services.postgres_dsn, min_size=1, max_size=1
            ) as pool:  # every event applied before the worker stops: all its spans out
                for _ in range(1200):  # 120 s at most
                    if await drained(pool, runs) >= backlog:
                        break
                    await asyncio.sleep(0.1)
    return rate


class _Discard(SpanExporter):
    def export(self, spans: object) -> SpanExportResult:
        return SpanExportResult.SUCCESS


@contextmanager
def _provider(ratio_: float | None) -> Iterator[None]:
    """This process traced at ``ratio_`` (None: untraced) for the block; OpenTelemetry
    sets a provider once per process, so it is reset after, as its own tests do."""
    if ratio_ is None:
        yield
        return
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio_)))
    provider.add_span_processor(BatchSpanProcessor(_Discard()))
    trace.set_tracer_provider(provider)
    try:
        yield
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER = None
        trace._TRACER_PROVIDER_SET_ONCE = Once()


def sdk_us(ratio_: float | None, calls: int) -> float:
    """Microseconds the SDK's tracing adds to one publish (its span and header)."""
    attrs = {"alma.tenant_id": "t", "alma.run_id": "r", "alma.event_id": "e"}
    with _provider(ratio_):
        started = time.perf_counter()
        for _ in range(calls):  # what Publisher.send adds around its send
            if tracing.active():
                with tracing.caller_span("publish node.completed", attributes=attrs):
                    tracing.inject()
        return (time.perf_counter() - started) / calls * 1e6


async def run(env: Env, section: Section) -> None:
    section.table(
        "tracing",
        "Traces: the checkpointer draining a backlog (1 KB states, "
        f"{RUNS} runs, one process) and the SDK's cost per publish",
        ["traces", "checkpoints/s", "× off", "spans exported", "SDK µs per publish"],
    )
    backlog = env.fewer(10_000 if env.quick else 20_000)
    calls = env.fewer(20_000)
    rates: dict[str, Stat] = {}
    with otlp_receiver() as receiver:
        for name, share in MODES:
            runs, spans, sdk = [], [], []
            for _ in range(env.reps):
                env.step(f"tracing: {name}")
                before = len(receiver.snapshot())
                rate = await drain(env, share, backlog, receiver.url)
                runs.append(rate)
                spans.append(float(len(receiver.snapshot()) - before))
                sdk.append(sdk_us(share, calls))
            env.done()
            rates[name] = Stat(runs, 0)
            section.add(
                "tracing",
                [name, rates[name], ratio(rates[name], rates["off"]), Stat(spans, 0), Stat(sdk, 1)],
            )
    section.note(
        "tracing",
        f"{backlog:,} events drained by `alma worker --consumers checkpointer`, exporting "
        "OTLP/HTTP to a receiver that decodes every request; the events carry a sampled "
        "`traceparent` in the share named (none with traces off), the worker samples "
        "`parentbased_traceidratio` alike. Spans exported: each sampled event's own, its "
        "batch's and the batch's transaction, cache write and outbox publish. The SDK column: "
        f"the span and header one publish adds, over {calls:,} calls (no provider: the one "
        "test `tracing.active()`).",
    )
