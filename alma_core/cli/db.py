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

db_app = typer.Typer(help="Database migrations and retention.")


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


@db_app.command("prune")
def prune(
    older_than_days: float = typer.Option(
        ..., "--older-than-days", min=0.0, help="Prune runs completed longer ago than this."
    ),
    batch_runs: int = typer.Option(200, min=1, help="Runs per transaction."),
    max_batches: int = typer.Option(1000, min=1, help="Stop after this many batches."),
) -> None:
    """Delete the checkpoints of runs completed long ago (never of an open run)."""
    s = common.settings()

    async def main() -> retention.PruneResult:
        async with connect(common.dsn(s), max_size=1) as pool:
            with common.out.status("pruning..."):
                return await retention.prune_checkpoints(
                    pool, older_than_days, batch_runs=batch_runs, max_batches=max_batches
                )

    result = common.run(main)
    common.out.print(
        f"pruned {result.checkpoints} checkpoints of {result.runs} runs "
        f"in {result.batches} batches" + ("; more left: run it again" if result.more else "")
    )
