"""The ``alma`` command line. Human tables by default, ``--json`` for scripts.

Exit codes: 0 done; 1 the operation failed (the message says what to do next);
2 wrong usage or settings.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from alma_core import cli_common as common
from alma_core import cli_demo, cli_memory, cli_runs, errors, reducer_store, reducers
from alma_core.logs import configure as configure_logs
from alma_core.migrations import Migrator
from alma_core.topics import alma_topics, describe_topics, ensure_topics
from consumers.worker import KNOWN_CONSUMERS, run_worker
from consumers.worker import Services as WorkerServices

app = typer.Typer(help="ALMA Stream: workflow memory over Kafka, Postgres and Redis.")
db_app = typer.Typer(help="Database migrations.")
topics_app = typer.Typer(help="Kafka topics.")
schemas_app = typer.Typer(help="The event contract's JSON Schema files.")
reducers_app = typer.Typer(help="Reducers.")
app.add_typer(db_app, name="db")
app.add_typer(topics_app, name="topics")
app.add_typer(schemas_app, name="schemas")
app.add_typer(reducers_app, name="reducers")
cli_runs.register(app)
cli_demo.register(app)
cli_memory.register(app, db_app)

# --- alma up ----------------------------------------------------------------


@app.command()
def up(
    partitions: int = typer.Option(
        None, help="Partitions per topic (ALMA_PARTITIONS, default 12)."
    ),
    data_dir: Path = typer.Option(None, help="Where embedded data lives (ALMA_DATA_DIR, .alma)."),
    check: bool = typer.Option(False, "--check", help="Bring everything up, report, then stop."),
) -> None:
    """Start the stack (embedded services for those not configured) until Ctrl-C."""
    s = common.settings(partitions=partitions, data_dir=data_dir)
    configure_logs(s.log_format, "WARNING" if s.log_level == "INFO" else s.log_level)

    async def main() -> None:
        started = time.monotonic()
        with common.out.status("starting broker, PostgreSQL and Redis..."):
            stack, endpoints = await common.bring_up(s)
        elapsed = time.monotonic() - started
        try:
            s.data_dir.mkdir(parents=True, exist_ok=True)
            (s.data_dir / common.ENDPOINTS_FILE).write_text(
                json.dumps(endpoints.as_dict(), indent=2)
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
                table.add_row(name, url, "embedded" if svc else "configured")
            table.add_row("topics", ", ".join(alma_topics(s)), f"{s.partitions} partitions")
            common.out.print(table)
            common.out.print(f"endpoints written to {s.data_dir / common.ENDPOINTS_FILE}")
            stop = _stop_on_signals()
            workers, status = await common.start_workers(s, endpoints, stop)
            common.out.print(f"workers running: {', '.join(KNOWN_CONSUMERS)}")
            base = f"http://127.0.0.1:{status.http_port}"
            common.out.print(
                f"metrics: {base}/metrics  health: {base}/healthz  ready: {base}/readyz"
            )
            (s.data_dir / common.ENDPOINTS_FILE).write_text(
                json.dumps({**endpoints.as_dict(), "metrics_url": f"{base}/metrics"}, indent=2)
            )
            if check:
                stop.set()
            else:
                common.out.print("Press Ctrl-C to stop.")
            await workers
        finally:
            with common.out.status("stopping..."):
                await stack.stop()
            (s.data_dir / common.ENDPOINTS_FILE).unlink(missing_ok=True)
            common.out.print("stopped")

    common.run(main)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


@app.command()
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
        stop = _stop_on_signals()
        await run_worker(s, services, names, stop)

    common.run(main)


# --- alma db ----------------------------------------------------------------


def _migrate(to: int | None, direction: str) -> None:
    """Move the schema one way only: an upgrade never drops, a downgrade never adds."""
    s = common.settings()

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            migrator = Migrator(conn)
            current = await migrator.current()
            if to is not None and (to < current if direction == "up" else to > current):
                other = "downgrade" if direction == "up" else "upgrade"
                raise errors.MigrationError(
                    f"the database is at version {current}; to reach {to}, use `alma db {other}`"
                )
            steps = await migrator.migrate(to)
        finally:
            await conn.close()
        for step in steps:
            verb = "applied" if step.direction == "up" else "reverted"
            common.out.print(f"{verb} {step.migration.version:04d}_{step.migration.name}")
        if not steps:
            common.out.print(f"already at version {current}")

    common.run(main)


@db_app.command("upgrade")
def db_upgrade(to: int = typer.Option(None, help="Target version (default: newest).")) -> None:
    """Apply migrations up to the newest (or --to)."""
    _migrate(to, "up")


@db_app.command("downgrade")
def db_downgrade(
    to: int = typer.Option(..., help="Version to go down to (0 removes everything)."),
) -> None:
    """Undo migrations down to --to. Data in dropped tables is lost."""
    _migrate(to, "down")


@db_app.command("status")
def db_status(as_json: bool = typer.Option(False, "--json")) -> None:
    """Which migrations are applied."""
    s = common.settings()

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            rows = await Migrator(conn).status()
        finally:
            await conn.close()
        if as_json:
            print(json.dumps([
                {"version": r.version, "name": r.name,
                 "applied_at": r.applied_at.isoformat() if r.applied_at else None}
                for r in rows
            ]))  # fmt: skip
            return
        table = Table(title="migrations")
        for col in ("version", "name", "applied at"):
            table.add_column(col)
        for r in rows:
            table.add_row(f"{r.version:04d}", r.name, str(r.applied_at or "[yellow]pending[/]"))
        common.out.print(table)

    common.run(main)


# --- alma topics --------------------------------------------------------------


@topics_app.command("create")
def topics_create(
    partitions: int = typer.Option(None, help="Partitions (ALMA_PARTITIONS)."),
) -> None:
    """Create ALMA's topics where missing."""
    s = common.settings(partitions=partitions)

    async def main() -> None:
        created = await ensure_topics(
            common.bootstrap(s), alma_topics(s), partitions=s.partitions,
            replication_factor=s.replication_factor,
        )  # fmt: skip
        common.out.print(f"created: {', '.join(created)}" if created else "all topics exist")

    common.run(main)


@topics_app.command("describe")
def topics_describe(as_json: bool = typer.Option(False, "--json")) -> None:
    """Partition counts of ALMA's topics."""
    s = common.settings()

    async def main() -> None:
        infos = await describe_topics(common.bootstrap(s), alma_topics(s))
        if as_json:
            print(json.dumps([i.__dict__ for i in infos]))
        else:
            table = Table(title="topics")
            for col in ("topic", "partitions", "note"):
                table.add_column(col)
            for i in infos:
                table.add_row(i.name, str(i.partitions), i.error or "")
            common.out.print(table)
        if any(i.error for i in infos):
            common.err.print("some topics are missing: run `alma topics create`")
            raise typer.Exit(1)

    common.run(main)


# --- alma schemas / reducers --------------------------------------------------


@schemas_app.command("export")
def schemas_export(
    check: bool = typer.Option(False, "--check", help="Fail if files drift."),
) -> None:
    """Regenerate schemas/*.json from the pydantic models."""
    from schemas import export

    raise typer.Exit(export.main(["--check"] if check else []))


@reducers_app.command("list")
def reducers_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """Reducers available by name (built-ins and the alma.reducers entry points)."""
    registry = reducers.default_registry()
    rows = [registry.get(n) for n in registry.names()]
    if as_json:
        print(
            json.dumps(
                [{"name": r.name, "expects": r.expects, "associative": r.associative} for r in rows]
            )
        )
        return
    table = Table(title="reducers")
    for col in ("name", "expects", "associative"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, r.expects, "yes" if r.associative else "no")
    common.out.print(table)


@reducers_app.command("set")
def reducers_set(
    workflow_id: str = typer.Argument(..., help="The workflow."),
    config_file: Path = typer.Argument(
        ...,
        help='JSON: {"reducers": {"field": "name"}, '
        '"default_reducer": "last_value", "strict": false}',
    ),
    tenant: str = typer.Option(..., "--tenant", help="The workflow's tenant."),
) -> None:
    """Register a workflow's reducers; joins and `updates` of its runs use them."""
    s = common.settings()
    try:
        data = json.loads(config_file.read_text())
    except OSError as exc:
        common.err.print(f"[red]error:[/red] cannot read {config_file}: {exc.strerror}")
        raise typer.Exit(2) from None
    except json.JSONDecodeError as exc:
        common.err.print(f"[red]error:[/red] {config_file} is not JSON: {exc}")
        raise typer.Exit(2) from None
    unknown = (
        set(data) - {"reducers", "default_reducer", "strict"} if isinstance(data, dict) else {}
    )
    if not isinstance(data, dict) or unknown or not isinstance(data.get("reducers", {}), dict):
        common.err.print(
            f'[red]error:[/red] {config_file} must be an object with "reducers" (an object '
            'of field -> reducer name), optional "default_reducer" and "strict"'
            + (f"; unknown keys: {', '.join(sorted(unknown))}" if unknown else "")
        )
        raise typer.Exit(2)
    config = reducers.ReducerConfig.from_json(data)

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            await reducer_store.save(conn, tenant, workflow_id, config)  # validates names first
        finally:
            await conn.close()
        common.out.print(f"reducers of workflow {workflow_id!r} (tenant {tenant!r}) saved")

    common.run(main)


@reducers_app.command("show")
def reducers_show(
    workflow_id: str = typer.Argument(..., help="The workflow."),
    tenant: str = typer.Option(..., "--tenant", help="The workflow's tenant."),
) -> None:
    """A workflow's registered reducers, as JSON."""
    s = common.settings()

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            config = await reducer_store.load(conn, tenant, workflow_id)
        finally:
            await conn.close()
        if config is None:
            raise errors.AlmaError(
                f"no reducers registered for workflow {workflow_id!r} of tenant {tenant!r}: "
                "`alma reducers set` registers them (runs use last_value meanwhile)"
            )
        print(json.dumps(config.to_json()))

    common.run(main)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
