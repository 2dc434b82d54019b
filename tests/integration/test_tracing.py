"""Traces: one run's join followed end to end in what the workers export over OTLP (a
receiver decoding it with OpenTelemetry's protobuf definitions), from the SDK's spans
through the checkpointer, the outbox, the joiner (SIGKILLed while it applies the
join, so its successor gets the join again) and the reply, to the learner's outcome;
and no trace ever holds another tenant's event."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.util._once import Once

from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from bench.otlp import ReceivedSpan, Receiver, otlp_receiver
from tests.integration.harness import WorkerProcess, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as r:
        yield r


@pytest.fixture
def orchestrator_tracing(receiver: Receiver) -> Iterator[TracerProvider]:
    """This process as an orchestrator that traces: its tracer provider exports to the
    receiver. OpenTelemetry sets a provider once per process; the test resets that
    (as OpenTelemetry's own tests do), so the other tests run untraced."""
    provider = TracerProvider(resource=Resource({"service.name": "orchestrator"}))
    exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    try:
        yield provider
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER = None
        trace._TRACER_PROVIDER_SET_ONCE = Once()


def traced_worker(
    settings: Settings, log: Path, consumers: str, receiver: Receiver
) -> WorkerProcess:
    worker = WorkerProcess(settings, log, consumers=consumers)
    worker.env |= {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,  # the exporter adds /v1/traces
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    return worker


async def joiner_waits_on(conn: asyncpg.Connection) -> bool:
    """Whether a session waits for the lock this test holds on ``joins``."""
    waiting = await conn.fetchval(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'joins'::regclass"
    )
    return bool(waiting)


async def test_a_join_followed_end_to_end_across_a_joiner_kill(
    settings: Settings, tmp_path: Path, receiver: Receiver, orchestrator_tracing: TracerProvider
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    tracer = trace.get_tracer("test")
    main = traced_worker(settings, tmp_path / "main.log", "checkpointer,learner", receiver)
    main.env["ALMA_MAX_STATE_BYTES"] = "4096"  # a larger state is a dead letter
    joiner = traced_worker(settings, tmp_path / "joiner.log", "joiner", receiver)
    main.start()
    joiner.start()
    try:
        await main.wait_started(120)
        await joiner.wait_started()
        async with AlmaClient(settings) as client:
            acme = WorkflowContext(tenant_id="acme", workflow_id="wf", run_id="r1")
            globex = WorkflowContext(tenant_id="globex", workflow_id="wf", run_id="r1")

            async def fan_out(ctx: WorkflowContext) -> None:
                for b in ("x", "y"):
                    at = WorkflowContext(ctx.tenant_id, "wf", None, "r1", f"work-{b}", b)
                    await client.node_completed(at, updates={"log": [b]}, wait="applied")

            # another tenant's run (the same run id), its own trace, fanned out at once:
            # both tenants' events share batches, their traces stay apart
            globex_root = tracer.start_span("orchestrate globex", context=otel_context.Context())
            with tracer.start_as_current_span("orchestrate acme") as acme_root:
                await asyncio.gather(fan_out(acme), _under(globex_root, fan_out(globex)))
                too_big = WorkflowContext("acme", "wf", None, "r-big", "n")
                refused = await client.node_completed(too_big, state={"blob": "x" * 8192})
                # The joiner reads acme's join and blocks on the table lock held here;
                # SIGKILLed there, its successor gets the join again (a redelivery).
                conn = await asyncpg.connect(dsn)
                try:
                    locked = conn.transaction()
                    await locked.start()
                    await conn.execute("LOCK TABLE joins IN EXCLUSIVE MODE")
                    merging = asyncio.ensure_future(
                        client.merge(
                            acme,
                            branch_ids=["x", "y"],
                            join_id="j1",
                            reducers={"log": "append"},
                            timeout=90,
                        )
                    )
                    await wait_for(
                        lambda: joiner_waits_on(conn), limit_s=60, what="the joiner to block"
                    )
                    joiner.kill()
                    await locked.rollback()
                finally:
                    await conn.close()
                joiner.start()
                reply = await merging
                assert reply.merged_state == {"log": ["x", "y"]}
                again = await client.merge(
                    acme, branch_ids=["x", "y"], join_id="j1", reducers={"log": "append"}
                )
                assert again.checkpoint_seq == reply.checkpoint_seq  # answered, not merged again
                await client.workflow_completed(
                    acme,
                    success=True,
                    duration_ms=1200,
                    node_count=2,
                    nodes_succeeded=2,
                    nodes_failed=0,
                    task="traced run",
                )
            with _span_of(globex_root):
                await client.merge(globex, branch_ids=["x", "y"], reducers={"log": "append"})
            globex_root.end()
        acme_trace = f"{acme_root.get_span_context().trace_id:032x}"
        globex_trace = f"{globex_root.get_span_context().trace_id:032x}"

        async def followed() -> list[ReceivedSpan] | None:
            spans = [s for s in receiver.snapshot() if s.trace_id == acme_trace]
            names = [s.name for s in spans]
            wanted = ("learner workflow.completed", "reply received", "outbox send reply")
            return spans if all(n in names for n in wanted) else None

        spans = await wait_for(followed, limit_s=60, what="the run's spans")
    finally:
        stopped = (joiner.terminate(), main.terminate())
    assert stopped == (0, 0)  # a clean stop exports what is buffered

    # the dead letter's log line carries the refused event's trace, not its batch's
    lines = [
        json.loads(line)
        for line in (tmp_path / "main.log").read_text().splitlines()
        if line.startswith("{")
    ]
    (letter,) = [d for d in lines if d.get("action") == "dead_letter"]
    assert (letter["event_id"], letter["reason"]) == (refused, "state_too_large")
    assert letter["trace_id"] == acme_trace

    everything = receiver.snapshot()
    by_id = {s.span_id: s for s in everything}
    spans = [s for s in everything if s.trace_id == acme_trace]
    if path := os.environ.get("ALMA_TRACE_PICTURE"):  # docs/operations.md's picture
        await asyncio.to_thread(waterfall_png, spans, Path(path))

    # Redis up: every event span of a worker says whether it is a redelivery, the first
    # reads of a partition too (they left it out before: a third of the spans)
    worker_events = [
        s for s in everything if s.service.startswith("alma-") and "alma.event_id" in s.attributes
    ]
    assert worker_events
    unsaid = [
        s.name for s in worker_events if not isinstance(s.attributes.get("alma.redelivery"), bool)
    ]
    assert unsaid == []

    def one(name: str, **attrs: Any) -> ReceivedSpan:
        found = [
            s
            for s in spans
            if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())
        ]
        assert len(found) == 1, (name, attrs, [(s.name, s.attributes) for s in spans])
        return found[0]

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        return by_id[span.parent_id]

    # The join's chain, parent by parent: the orchestrator's merge and publish, the
    # checkpointer's span of the event, the hand-off sent by the outbox, the joiner's
    # span, the reply sent, the reply received back in the orchestrator.
    merge = [s for s in spans if s.name == "merge" and s.service == "orchestrator"]
    assert len(merge) == 2
    assert all(parent(m).name == "orchestrate acme" for m in merge)
    first = min(merge, key=lambda s: s.start_ns)
    publishes = [s for s in spans if s.name == "publish branch.join"]
    publish = next(p for p in publishes if p.parent_id == first.span_id)
    checkpointed = next(
        s for s in spans if s.name == "checkpointer branch.join" and s.parent_id == publish.span_id
    )
    assert checkpointed.service == "alma-worker"
    assert checkpointed.attributes["alma.outcome"] == "handed_off"
    assert checkpointed.attributes["alma.tenant_id"] == "acme"
    handoff = next(
        s for s in spans if s.name == "outbox send handoff" and s.parent_id == checkpointed.span_id
    )
    joined = [s for s in spans if s.name == "joiner branch.join" and s.parent_id == handoff.span_id]
    # killed while applying it: the joiner that died exported nothing of it, its
    # successor's span of the same record says it is a redelivery
    assert len(joined) == 1
    join = joined[0]
    assert join.service == "alma-joiner"
    assert join.attributes["alma.redelivery"] is True
    assert join.attributes["alma.outcome"] == "ok"
    assert join.attributes["alma.join.answered_before"] is False
    assert join.attributes["alma.seq"] == reply.checkpoint_seq
    assert join.attributes["alma.join_id"] == "j1"
    sent = next(s for s in spans if s.name == "outbox send reply" and s.parent_id == join.span_id)
    received = next(s for s in spans if s.name == "reply received" and s.parent_id == sent.span_id)
    assert received.service == "orchestrator"
    # the batch that carried the join: its own trace, linked from the join's span
    batch = by_id[join.links[0][1]]
    assert batch.name == "joiner batch"
    assert batch.trace_id != acme_trace
    assert {s.name for s in everything if s.parent_id == batch.span_id} >= {"joiner transaction"}
    # the same join asked again: answered from the stored reply, nothing merged twice
    second = max(merge, key=lambda s: s.start_ns)
    asked_again = [
        s
        for s in spans
        if s.name == "joiner branch.join" and parent(parent(parent(s))).parent_id == second.span_id
    ]
    assert [s.attributes["alma.join.answered_before"] for s in asked_again] == [True]
    assert asked_again[0].attributes["alma.outcome"] == "duplicate"
    # the outcome, learned, in the same trace
    learned = one("learner workflow.completed")
    assert learned.attributes["alma.outcome"] == "learned"
    assert learned.service == "alma-worker"
    # the fan-out's events: checkpointed, each with its seq, children of their publishes
    for node in ("work-x", "work-y"):
        event = one("checkpointer node.completed", **{"alma.node_id": node})
        assert parent(event).name == "publish node.completed"
        assert event.attributes["alma.outcome"] == "checkpointed"
        assert isinstance(event.attributes["alma.seq"], int)
    # no state content in any span, and no trace crosses tenants
    for s in everything:
        assert not any("state" in k or "payload" in k for k in s.attributes), s
    for trace_id, tenant in ((acme_trace, "acme"), (globex_trace, "globex")):
        tenants = {
            s.attributes["alma.tenant_id"]
            for s in everything
            if s.trace_id == trace_id and "alma.tenant_id" in s.attributes
        }
        assert tenants == {tenant}
    batches = [s for s in everything if s.name.endswith(" batch")]
    assert batches
    assert all("alma.tenant_id" not in s.attributes for s in batches)


async def _under(span: trace.Span, work: Any) -> Any:
    with _span_of(span):
        return await work


def _span_of(span: trace.Span) -> Any:
    return trace.use_span(span, end_on_exit=False)


def waterfall_png(spans: list[ReceivedSpan], path: Path) -> None:
    """The trace as a waterfall (one bar per span, in start order, indented by depth):
    docs/img/trace-join.png, made with ``ALMA_TRACE_PICTURE=docs/img/trace-join.png``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    ids = {s.span_id: s for s in spans}

    def depth(s: ReceivedSpan) -> int:
        d = 0
        while s.parent_id in ids:
            s, d = ids[s.parent_id], d + 1
        return d

    ordered = sorted(spans, key=lambda s: s.start_ns)
    t0 = ordered[0].start_ns
    colours = {"orchestrator": "#4c72b0", "alma-worker": "#55a868", "alma-joiner": "#c44e52"}
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(ordered) + 1.2))
    for i, s in enumerate(ordered):
        start, ms = (s.start_ns - t0) / 1e6, max(s.ms, 0.5)
        ax.barh(i, ms, left=start, color=colours.get(s.service, "#8172b2"), height=0.7)
        flag = "  REDELIVERY" if s.attributes.get("alma.redelivery") else ""
        ax.text(start + ms + 15, i, f"{s.ms:.1f} ms{flag}", va="center", fontsize=7)
    ax.set_yticks(range(len(ordered)))
    labels = [f"{chr(0x2003) * 2 * depth(s)}{s.name}" for s in ordered]  # em spaces: depth
    ax.set_yticklabels(labels, fontsize=7, ha="left")
    ax.tick_params(axis="y", pad=260)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the orchestrator's first span")
    ax.set_title(
        "One run's join: blue the orchestrator, green the checkpointer and learner, red the joiner",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
