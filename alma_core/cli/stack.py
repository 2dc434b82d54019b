"""``alma up`` (the embedded stack and every worker in one process) and ``alma worker``
(consumer groups against configured services). The only module of the command line
that imports ``consumers``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from alma_core import errors, stacks
from alma_core.cli import common, embedded_secure
from alma_core.cli.embedded import (
    BrokerKind,
    EmbeddedStack,
    Endpoints,
    choose_broker,
    in_memory,
)
from alma_core.cli.embedded_process import Notify, log_notice, write_private
from alma_core.cli.embedded_secure import ADMIN, WORKER
from alma_core.cli.embedded_supervisor import (
    Limits,
    RestartPolicy,
    ServiceLost,
    Supervisor,
    Watch,
)
from alma_core.cli.topics import alma_topics, ensure_topics
from alma_core.consumers.lag import run_lag_exporter
from alma_core.consumers.worker import (
    KNOWN_CONSUMERS,
    WorkerStatus,
    freeze_when_ready,
    run_worker,
)
from alma_core.consumers.worker import Services as WorkerServices
from alma_core.heap import freeze_heap
from alma_core.logs import configure as configure_logs
from alma_core.logs import redact
from alma_core.messaging import acls, kafka, kafka_admin
from alma_core.pids import alive
from alma_core.settings import Settings, for_broker
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.migrations import Migrator

WORKERS_DRAIN_S = 30.0  # how long the workers get to stop after a service died


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("worker")(worker)
    app.command("lag-exporter")(lag_exporter)


def up(
    partitions: int = typer.Option(
        None, help="Partitions per topic (ALMA_PARTITIONS, default 12)."
    ),
    data_dir: Path = typer.Option(None, help="Where embedded data lives (ALMA_DATA_DIR, .alma)."),
    check: bool = typer.Option(False, "--check", help="Bring everything up, report, then stop."),
    broker: str = typer.Option(
        None,
        help="The broker to start when ALMA_KAFKA_BOOTSTRAP is unset: kafka (Apache Kafka, "
        "on disk), tansu (in memory) or auto (ALMA_EMBEDDED_BROKER, default auto: kafka "
        "where Java 17+ and `make kafka`'s jars are found).",
    ),
    secure: bool = typer.Option(
        False,
        "--secure",
        help="A shared stack: Apache Kafka with SASL/SCRAM over TLS and its authorizer, "
        "tenant topics, PostgreSQL and Redis asking passwords; tenants come with `alma "
        "tenants add` (a data directory made so stays so).",
    ),
) -> None:
    """Start the stack (embedded services for those not configured) until Ctrl-C."""
    s = common.settings(
        beside=False, partitions=partitions, data_dir=data_dir, embedded_broker=broker
    )
    configure_logs(s.log_format, "WARNING" if s.log_level == "INFO" else s.log_level)
    if not secure and embedded_secure.made_secure(s.data_dir.resolve()):
        common.note(f"{s.data_dir} holds a secured stack (made with --secure): secured again")
        secure = True
    secrets = None
    if secure:
        try:
            embedded_secure.check_can_secure(s)
        except errors.ConfigError as exc:
            common.fail(exc.message, common.USAGE)
        secrets = embedded_secure.load_or_make(s.data_dir)
        s = secrets.settings_for(s.model_copy(update={"embedded_broker": "kafka"}), ADMIN)

    async def main() -> None:
        endpoints_file = s.data_dir / common.ENDPOINTS_FILE
        _claim(endpoints_file)
        started = time.monotonic()
        with common.out.status("starting broker, PostgreSQL and Redis..."):
            stack, endpoints = await bring_up(s, notify=common.note, secrets=secrets)
        elapsed = time.monotonic() - started
        ws = for_broker(s, embedded=in_memory(stack))
        if secrets is not None:  # the workers are their own principal, not the admin
            ws = secrets.settings_for(ws, WORKER)
        try:
            # The real DSNs, for the commands and applications beside this one: mode 0600.
            mine = {
                **endpoints.as_dict(),
                "pid": os.getpid(),
                "fetch_max_wait_ms": ws.fetch_max_wait_ms,
                "broker": stack.broker.kind if stack.broker else "configured",
                "partitions": s.partitions,  # a tenant's topics are made with as many
                **(secrets.endpoints_entry() if secrets else {}),
            }
            write_private(endpoints_file, json.dumps(mine, indent=2))
            try:  # found from any directory
                stacks.register(s.stacks_dir, s.data_dir)
            except OSError as exc:
                common.note(
                    f"cannot register this stack in {s.stacks_dir} ({exc.strerror}): commands "
                    f"find it from {s.data_dir.resolve().parent} and below, or with "
                    "ALMA_DATA_DIR; set ALMA_STACKS_DIR to a writable directory"
                )
            table = Table(title=f"ALMA Stream is up ({elapsed:.1f} s)")
            table.add_column("service")
            table.add_column("endpoint")
            table.add_column("source")
            for name, url, svc in (
                ("Kafka", endpoints.kafka_bootstrap, stack.broker),
                ("PostgreSQL", endpoints.postgres_dsn, stack.postgres),
                ("Redis", endpoints.redis_url, stack.redis),
            ):
                table.add_row(name, redact(url), "embedded" if svc else "configured")
            if stack.broker is not None:
                table.add_row("broker", stack.broker.title, stack.broker_reason)
            if secrets is not None:
                table.add_row(
                    "secured",
                    f"SASL/SCRAM over TLS (CA {secrets.ca}), ACLs, passwords",
                    f"principals {ADMIN}, {WORKER}; tenants: alma tenants add T",
                )
            table.add_row("topics", ", ".join(alma_topics(s)), f"{s.partitions} partitions")
            common.out.print(table)
            common.out.print(f"endpoints written to {endpoints_file} (readable by its owner only)")
            stop = _stop_on_signals()
            workers, status = await start_workers(ws, endpoints, stop)
            if ws.gc_freeze:
                freeze_heap()
            common.out.print(f"workers running: {', '.join(KNOWN_CONSUMERS)}")
            base = f"http://127.0.0.1:{status.http_port}"
            common.out.print(
                f"metrics: {base}/metrics  health: {base}/healthz  ready: {base}/readyz"
            )
            common.out.print(traces_line(ws), markup=False)
            running = {"metrics_url": f"{base}/metrics", "embed_url": f"{base}/embed"}
            write_private(endpoints_file, json.dumps({**mine, **running}, indent=2))
            if check:
                stop.set()
            else:
                common.out.print("Press Ctrl-C to stop.")
            await _supervise(ws, stack, workers, status, stop)
        finally:
            with common.out.status("stopping..."):
                await stack.stop()
            endpoints_file.unlink(missing_ok=True)
            stacks.unregister(s.stacks_dir)
            common.out.print("stopped")

    common.run(main)


def traces_line(s: Settings) -> str:
    """Where the workers' spans go, as ``alma up`` says it (docs/operations.md, "Traces")."""
    exporter = s.traces_exporter
    if exporter == "none":
        return "traces: off (set OTEL_EXPORTER_OTLP_ENDPOINT to export them)"
    if exporter == "console":
        return "traces: on, printed to the workers' output (OTEL_TRACES_EXPORTER=console)"
    endpoint = s.otel_exporter_otlp_endpoint or "http://localhost:4318 (the OTLP default)"
    return f"traces: on, exported over OTLP/HTTP to {redact(endpoint)}"


def _claim(endpoints_file: Path) -> None:
    """Refuse to start beside a running `alma up` on the same data directory; remove
    the endpoints file of one that is gone (saying so), or commands would use it."""
    if not endpoints_file.exists():
        return
    try:
        pid = int(json.loads(endpoints_file.read_text()).get("pid") or 0)
    except (OSError, ValueError, AttributeError):
        pid = 0
    if pid and pid != os.getpid() and alive(pid):
        raise errors.StackError(
            f"another `alma up` (pid {pid}) is running on {endpoints_file.parent}. What to "
            "do: use that one, stop it, or give this one another ALMA_DATA_DIR"
        )
    common.note(
        f"removed the stale {endpoints_file} of an `alma up` that is gone"
        + (f" (pid {pid})" if pid else "")
    )
    endpoints_file.unlink(missing_ok=True)


async def _supervise(
    s: Settings,
    stack: EmbeddedStack,
    workers: asyncio.Task[None],
    status: WorkerStatus,
    stop: asyncio.Event,
) -> None:
    """Wait for the workers (they end when ``stop`` is set) while the supervisor keeps
    the embedded services running and the watch samples them. When a service cannot be
    kept (the broker died, or one died too often), say so, stop the workers and exit 1
    (the caller stops the other services)."""
    metrics = status.metrics
    assert metrics is not None
    embedded = metrics.embedded
    supervisor = Supervisor(
        stack,
        notify=common.note,
        policy=RestartPolicy(limit=s.embedded_restart_limit),
        on_restart=lambda name: embedded.restarts.labels(name).inc(),
        unapplied=lambda: _unapplied(status),
    )
    watch = Watch(
        stack,
        notify=common.note,
        memory=lambda name, held: embedded.memory.labels(name).set(held),
        logs=lambda: _log_ends(status),
        log_length=lambda t, p, n: embedded.log_records.labels(t, str(p)).set(n),
        limits=Limits(s.embedded_warn_broker_mb << 20, s.embedded_warn_partition_records),
    )
    supervising = asyncio.create_task(supervisor.run(stop))
    watching = asyncio.create_task(watch.run(stop))
    try:
        await asyncio.wait([workers, supervising], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if workers.done() or not supervising.done() or supervising.exception() is None:
        supervising.cancel()
        await workers  # the workers' error, if they failed
        return
    try:
        supervising.result()
    except ServiceLost as lost:  # anything else is a defect of the supervisor: it goes up
        common.err.print(f"[red]error:[/red] {escape(redact(lost.message))}", soft_wrap=True)
    stop.set()
    try:
        await asyncio.wait_for(workers, WORKERS_DRAIN_S)
    except Exception as exc:  # noqa: BLE001 - already failing: the service's death is the news
        common.note(f"the workers stopped with {exc!r}")
    raise typer.Exit(common.FAILED)


def _log_ends(status: WorkerStatus) -> dict[tuple[str, int], int]:
    """Each partition's log end, as this process's consumers last fetched it."""
    ends: dict[tuple[str, int], int] = {}
    for runtime in status.runtimes:
        for partition, (end, _) in runtime.logs().items():
            if end is not None:
                ends[partition] = max(end, ends.get(partition, 0))
    return ends


def _unapplied(status: WorkerStatus) -> str:
    """Per partition, how far the log went and how far each group had applied it."""
    lines = []
    for runtime in status.runtimes:
        for (topic, partition), (end, applied) in sorted(runtime.logs().items()):
            if end is not None and applied is not None and end > applied:
                lines.append(
                    f"  {topic} partition {partition}: the log reached offset {end:,}, the "
                    f"{runtime.handler.name} had applied up to {applied:,}: at least "
                    f"{end - applied:,} records lost"
                )
    return "\n".join(lines)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def worker(
    consumers: str = typer.Option(
        ",".join(KNOWN_CONSUMERS), help=f"Comma-separated: {', '.join(KNOWN_CONSUMERS)}."
    ),
) -> None:
    """Run consumer groups against the configured services until SIGTERM or Ctrl-C."""
    s = common.settings()
    configure_logs(s.log_format, s.log_level)
    names = [c.strip() for c in consumers.split(",") if c.strip()]

    async def main() -> None:
        services = WorkerServices(common.bootstrap(s), common.dsn(s), common.redis_url(s))
        stop, ready = _stop_on_signals(), asyncio.Event()
        freezing = asyncio.create_task(freeze_when_ready(ready)) if s.gc_freeze else None
        try:
            await run_worker(s, services, names, stop, ready=ready)
        finally:
            if freezing is not None:
                freezing.cancel()

    common.run(main)


def lag_exporter(
    port: int = typer.Option(9465, help="Where /metrics, /healthz and /readyz listen."),
    interval: float = typer.Option(15.0, min=1.0, help="Seconds between questions to Kafka."),
) -> None:
    """Export the ALMA groups' lag as the broker sees it (kafka_exporter's metric names),
    until SIGTERM or Ctrl-C: honest when a group died or hangs, unlike a worker's own."""
    s = common.settings()
    configure_logs(s.log_format, s.log_level)

    async def main() -> None:
        stop = _stop_on_signals()
        await run_lag_exporter(s, common.bootstrap(s), stop, port=port, interval_s=interval)

    common.run(main)


async def bring_up(
    s: Settings,
    *,
    durable: bool = True,
    notify: Notify = log_notice,
    secrets: embedded_secure.Secrets | None = None,
) -> tuple[EmbeddedStack, Endpoints]:
    """Start what is not configured, create topics, migrate (with ``secrets``, secured,
    ``s`` its admin's, and the workers' principal granted its ACLs). The caller stops
    the stack. ``notify`` hears what the embedded services change on the host first."""
    kind: BrokerKind = "tansu"
    reason = ""
    if not s.kafka_bootstrap:
        kind, reason = choose_broker(s.embedded_broker, s.kafka_libs)
    stack = EmbeddedStack(
        s.data_dir,
        kafka_bootstrap=s.kafka_bootstrap,
        postgres_dsn=s.postgres_dsn,
        redis_url=s.redis_url,
        durable=durable,
        notify=notify,
        broker=kind,
        kafka_libs=s.kafka_libs,
        kafka_heap_mb=s.embedded_kafka_heap_mb,
        broker_reason=reason,
        secrets=secrets,
    )
    endpoints = await stack.start()
    try:
        await ensure_topics(
            endpoints.kafka_bootstrap,
            alma_topics(s),
            partitions=s.partitions,
            replication_factor=s.replication_factor,
            client_options=kafka.client_options(s),
            max_record_bytes=s.max_record_bytes,
        )
        if secrets is not None:
            async with kafka_admin.connected(endpoints.kafka_bootstrap, s) as admin:
                await kafka_admin.grant(admin, f"User:{WORKER}", acls.for_role("worker", s))
        conn = await common.connect(endpoints.postgres_dsn)
        try:
            await Migrator(conn).migrate()
        finally:
            await conn.close()
    except BaseException:
        await stack.stop()
        raise
    return stack, endpoints


async def start_workers(
    s: Settings,
    endpoints: Endpoints,
    stop: asyncio.Event,
    embedder: AsyncEmbedder | None = None,
) -> tuple[asyncio.Task[None], WorkerStatus]:
    """Every consumer group in this process on ``endpoints``, once ready (their
    error, if they fail first); they run until ``stop`` is set."""
    if "metrics_port" not in s.model_fields_set:
        # A stack's ports are all chosen free, /metrics's too (ALMA_METRICS_PORT pins
        # it; `alma up` and `alma demo` print it), so a second stack starts beside one.
        s = s.model_copy(update={"metrics_port": 0})
    ready, status = asyncio.Event(), WorkerStatus()
    services = WorkerServices(
        endpoints.kafka_bootstrap, endpoints.postgres_dsn, endpoints.redis_url
    )
    task = asyncio.create_task(
        run_worker(
            s, services, list(KNOWN_CONSUMERS), stop, ready=ready, status=status, embedder=embedder
        )
    )
    waiter = asyncio.ensure_future(ready.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()  # raises the worker's error
    return task, status
