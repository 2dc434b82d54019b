"""``alma demo`` (the README's first command) and ``alma mcp`` (tools for agents)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import typer
from rich.progress import Progress
from rich.table import Table

from alma_core import settings as settings_mod
from alma_core.cli import common
from alma_core.cli.demo_workflows import Demo, DemoReport
from alma_core.cli.embedded import in_memory
from alma_core.cli.stack import bring_up, start_workers
from alma_core.logs import configure as configure_logs
from alma_core.sdk.client import AlmaClient
from alma_core.storage.embeddings import AsyncEmbedder, load_embedder
from alma_core.storage.observer import ReadObserver
from alma_core.storage.postgres import connect


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@contextlib.asynccontextmanager
async def _stack(
    s: settings_mod.Settings,
) -> AsyncIterator[tuple[settings_mod.Settings, str, AsyncEmbedder | None, ReadObserver | None]]:
    """A running `alma up` if there is one; else the embedded stack (services not
    configured) with the three workers in this process. Yields the settings with
    every service, the metrics URL, the workers' embedder (to share) and their
    metrics (the demo's reads are reported there too)."""
    running = common.running_endpoints(s)
    if running.get("metrics_url"):
        common.out.print("using the stack of the running `alma up`")
        yield common.resolved(s), str(running["metrics_url"]), None, None
        return
    with common.out.status("starting broker, PostgreSQL and Redis..."):
        stack, endpoints = await bring_up(s, notify=common.note)
    try:
        resolved = settings_mod.for_broker(common.resolved(s, endpoints), embedded=in_memory(stack))
        with common.out.status("loading the embedding model and starting the workers..."):
            embedder = await asyncio.to_thread(load_embedder, s)
            stop = asyncio.Event()
            workers, status = await start_workers(resolved, endpoints, stop, embedder)
        try:
            url = f"http://127.0.0.1:{status.http_port}/metrics"
            yield resolved, url, embedder, status.metrics
        finally:
            stop.set()
            await workers
            embedder.close()
    finally:
        with common.out.status("stopping..."):
            await stack.stop()


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p50 = ordered[len(ordered) // 2] * 1000
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000
    return f"{p50:.0f} / {p95:.0f}"


def _summary(report: DemoReport, elapsed: float, total: float) -> Table:
    ok = sum(r.success for r in report.runs)
    table = Table(
        title=f"ALMA Stream demo: {len(report.runs)} workflow runs, learned and retrieved "
        f"in {elapsed:.1f} s ({total:.1f} s with start-up)"
    )
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("notes")
    c = report.counts
    rows = [
        (
            "runs",
            f"{c.get('runs', 0)}",
            f"{ok} succeeded, {len(report.runs) - ok} failed, "
            f"{len(report.resume_seconds)} resumed after a crash",
        ),
        ("checkpoints", f"{c.get('checkpoints', 0)}", "ordered, gapless, exactly once"),
        (
            "joins",
            f"{c.get('joins', 0)}",
            "3 branches each: sources append, tokens sum, confidence max",
        ),
        ("outcomes learned", f"{c.get('outcomes', 0)}", "with all-MiniLM-L6-v2 embeddings"),
        (
            "memories (demo tenants)",
            f"{c.get('memories', 0)}",
            "heuristics, anti-patterns, node outcomes",
        ),
        (
            "dead letters",
            f"{c.get('dead letters', 0)}",
            f"{report.stale_writes_refused} stale optimistic writes refused, on purpose",
        ),
        (
            "concurrent increments",
            "{} / {}".format(*report.concurrent_increments),
            "sent / counted: none lost",
        ),
        ("checkpoint p50 / p95 ms", _ms(report.checkpoint_seconds), "publish → durable"),
        ("merge p50 / p95 ms", _ms(report.merge_seconds), "join → durable merged reply"),
        ("resume p50 / p95 ms", _ms(report.resume_seconds), "new orchestrator → run finished"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def demo(
    runs: int = typer.Option(24, min=1, max=500, help="How many workflow runs."),
    as_json: bool = common.json_option("the summary"),
) -> None:
    """Run realistic workflows through the SDK and show what ALMA Stream made of them."""
    s = common.settings()
    # the demo's dead letters are on purpose: the summary counts them, logs would repeat them
    configure_logs(s.log_format, "ERROR" if s.log_level == "INFO" else s.log_level)

    async def main() -> None:
        began = time.monotonic()
        async with (
            _stack(s) as (resolved, metrics_url, embedder, observer),
            AlmaClient(resolved, embedder=embedder, observer=observer) as client,
        ):
            d = Demo(client, runs=runs)
            started = time.monotonic()
            with Progress(console=common.out, transient=not common.out.is_terminal) as bar:
                task = bar.add_task("workflow runs", total=runs)
                report = await d.run(lambda: bar.advance(task))
            async with connect(resolved.postgres_dsn or "", max_size=2) as pool:
                with common.out.status("waiting for the learner..."):
                    await d.wait_learned(pool, timeout=120)
                report.counts = await d.count(pool)
            with common.out.status("retrieving what was learned..."):
                report.retrieval = await d.retrieve()
            elapsed = time.monotonic() - started
            kept = embedder is None  # the stack of a running `alma up`: it stays up
            took = (elapsed, time.monotonic() - began)
            _print(report, took, metrics_url, kept=kept, as_json=as_json)

    common.run(main)


EXPLORE = (
    "`alma runs list --tenant acme`, `alma runs show RUN --tenant acme`, "
    "`alma retrieve 'task' --tenant acme --workflow research-report`"
)


def _next(metrics_url: str, *, kept: bool) -> str:
    """What to do next, as printed: a stack that is still up is explored at once; the
    demo's own has stopped (its data stays in the data directory): start `alma up` first."""
    if kept:
        return f"metrics: {metrics_url}\nexplore, from any directory: {EXPLORE}"
    return (
        "the demo's stack has stopped; what it wrote stays in its data directory. To "
        f"explore it: start `alma up` here (it keeps running), then, from any directory: {EXPLORE}"
    )


def _print(
    report: DemoReport,
    took: tuple[float, float],
    metrics_url: str,
    *,
    kept: bool,
    as_json: bool,
) -> None:
    """The summary, then what to do next (with --json: the summary on stdout, the next
    step on stderr); ``kept``: the stack (a running `alma up`'s) is still up."""
    found = report.retrieval
    if as_json:
        print(
            json.dumps(
                {
                    "counts": report.counts,
                    "succeeded": sum(r.success for r in report.runs),
                    "failed": sum(not r.success for r in report.runs),
                    "resumed": len(report.resume_seconds),
                    "stale_writes_refused": report.stale_writes_refused,
                    "concurrent_increments": list(report.concurrent_increments),
                    "retrieval": found.to_doc(400) if found else None,
                    "metrics_url": metrics_url,
                    "stack_running": kept,
                }
            )
        )
        common.err.print(_next(metrics_url, kept=kept), markup=False)
        return
    common.out.print(_summary(report, *took))
    if found is not None:
        common.out.print(
            f"\n[bold]retrieve[/bold]('write a research report on battery storage', tenant acme, "
            f"workflow research-report, WORKFLOW scope): {len(found.items())} items, "
            f"{found.plan} search, {found.retrieval_time_ms or 0:.1f} ms. to_prompt(400):"
        )
        common.out.print(found.to_prompt(max_tokens=400) or "(nothing learned yet)", markup=False)
    common.out.print("\n" + _next(metrics_url, kept=kept), markup=False)
