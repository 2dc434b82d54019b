"""``alma db``: migrations (upgrade, downgrade, status) and retention (prune)."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from alma_core import errors
from alma_core.cli import common
from alma_core.storage import retention
from alma_core.storage.migrations import Migrator
from alma_core.storage.postgres import connect

db_app = common.app(help="Database migrations and retention.")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")


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
def db_status(as_json: bool = common.json_option("the schema version and migrations")) -> None:
    """Which migrations are applied."""
    s = common.settings()

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            rows = await Migrator(conn).status()
        finally:
            await conn.close()
        if as_json:
            print(
                json.dumps(
                    [
                        {
                            "version": r.version,
                            "name": r.name,
                            "applied_at": r.applied_at.isoformat() if r.applied_at else None,
                        }
                        for r in rows
                    ]
                )
            )
            return
        table = Table(title="migrations")
        for col in ("version", "name", "applied at"):
            table.add_column(col)
        for r in rows:
            table.add_row(f"{r.version:04d}", r.name, str(r.applied_at or "[yellow]pending[/]"))
        common.out.print(table)

    common.run(main)


_DAYS = "Days; default: the setting ({}), 0 keeps forever."


@db_app.command("prune")
def prune(
    checkpoints_days: float | None = typer.Option(
        None,
        min=0.0,
        help="Checkpoints of runs completed this long ago. "
        + _DAYS.format("ALMA_CHECKPOINT_RETENTION_DAYS"),
    ),
    events_days: float | None = typer.Option(
        None,
        min=0.0,
        help="Event log and join replies of runs completed this long ago. "
        + _DAYS.format("ALMA_EVENT_RETENTION_DAYS"),
    ),
    runs_days: float | None = typer.Option(
        None,
        min=0.0,
        help="Rows of runs completed this long ago, once pruned. "
        + _DAYS.format("ALMA_RUN_RETENTION_DAYS"),
    ),
    dead_letters_days: float | None = typer.Option(
        None,
        min=0.0,
        help="Dead letters this old. " + _DAYS.format("ALMA_DEAD_LETTER_RETENTION_DAYS"),
    ),
    outcome_memories_days: float | None = typer.Option(
        None,
        min=0.0,
        help="Node-outcome memories this old. "
        + _DAYS.format("ALMA_OUTCOME_MEMORY_RETENTION_DAYS"),
    ),
    superseded_days: float | None = typer.Option(
        None,
        min=0.0,
        help="Checkpoint states replaced by `alma replay --apply` this long ago. "
        + _DAYS.format("ALMA_SUPERSEDED_RETENTION_DAYS"),
    ),
    batch: int = typer.Option(200, min=1, help="Runs (or rows) per transaction."),
    max_batches: int = typer.Option(1000, min=1, help="Stop each step after this many batches."),
) -> None:
    """Delete what outlived its retention: checkpoints, event logs and runs of closed runs
    (never of an open run), old dead letters, node-outcome memories and superseded
    checkpoint states."""
    s = common.settings(
        checkpoint_retention_days=checkpoints_days,
        event_retention_days=events_days,
        run_retention_days=runs_days,
        dead_letter_retention_days=dead_letters_days,
        outcome_memory_retention_days=outcome_memories_days,
        superseded_retention_days=superseded_days,
    )

    async def main() -> retention.PruneResult:
        async with connect(common.dsn(s), max_size=1) as pool:
            with common.out.status("pruning..."):
                result = await retention.prune(
                    pool, s.retention, batch_runs=batch, max_batches=max_batches
                )
        await common.forget_cached(s, result.pruned)
        return result

    result = common.run(main)
    if not s.retention.active and not result.runs:
        common.err.print(
            "nothing to prune: every retention is 0 (keep forever), and no tenant's own "
            "checkpoint retention (`alma tenants set T --checkpoint-retention-days D`) was due"
        )
        raise typer.Exit(0)
    table = Table("table", "rows deleted")
    for name, n in result.rows().items():
        table.add_row(name, str(n))
    common.out.print(table)
    common.out.print(
        f"pruned {result.checkpoints} checkpoints of {result.runs} runs "
        f"in {result.batches} batches" + ("; more left: run it again" if result.more else "")
    )
