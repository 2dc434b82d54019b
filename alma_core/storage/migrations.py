"""Numbered SQL migrations: ``sql/migrations/NNNN_name.up.sql`` and ``.down.sql``.

Applied versions are recorded in ``alma_schema_version``. Each step runs in its
own transaction under an advisory lock, so two processes upgrading at once
apply every step once. Planning is pure (:func:`plan`); :class:`Migrator` does
the I/O.

Rolling upgrades: a migration's up file may declare, in a comment line,
``-- oldest-worker: N``: workers built for schema N (and later) still run on the
schema it makes. Additive migrations (new tables, nullable columns, indexes)
declare the version before them, so old pods keep running while new ones roll out
and a rollback needs no downgrade; a destructive one (a drop, a changed key)
declares itself, and comes in a later release than the change that stopped
needing what it drops. Without the line a migration admits only workers built for
it. The floor is recorded with each applied version, so a worker older than the
migration files still reads it (:func:`compatibility`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Literal

import asyncpg

from alma_core import errors

VERSION_TABLE = "alma_schema_version"
_LOCK_KEY = 0x414C4D41  # "ALMA"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.(up|down)\.sql$")
_OLDEST_WORKER = re.compile(r"^--\s*oldest-worker:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    up: str
    down: str

    @property
    def oldest_worker(self) -> int:
        """The oldest schema version a worker may be built for and still run on this
        one (the ``-- oldest-worker: N`` line; without it, this version)."""
        match = _OLDEST_WORKER.search(self.up)
        return int(match[1]) if match else self.version


def compatibility(built_for: int, current: int, oldest_worker: int) -> str | None:
    """Why a worker built for schema ``built_for`` cannot run on a database at
    ``current`` whose applied migrations admit workers from ``oldest_worker`` on, or
    None when it can: the schema must have every migration the worker knows, and must
    still admit it."""
    if current < built_for:
        return (
            f"the database schema is at version {current}, this ALMA Stream needs "
            f"{built_for}: run `alma db upgrade` (the migration Job, in Kubernetes)"
        )
    if oldest_worker > built_for:
        return (
            f"the database schema is at version {current}, which admits workers built for "
            f"schema {oldest_worker} or later; this ALMA Stream is built for {built_for}: "
            f"deploy a release built for schema {oldest_worker} or later (or, losing what "
            f"the newer migrations hold, `alma db downgrade --to {built_for}` with that release)"
        )
    return None


@dataclass(frozen=True)
class Step:
    migration: Migration
    direction: Literal["up", "down"]

    @property
    def sql(self) -> str:
        return self.migration.up if self.direction == "up" else self.migration.down


@dataclass(frozen=True)
class MigrationStatus:
    version: int
    name: str
    applied_at: datetime | None


def load_migrations() -> list[Migration]:
    """Every migration shipped with the package, in version order, each with up and down."""
    folder = resources.files("alma_core.storage") / "sql" / "migrations"
    parts: dict[int, dict[str, str]] = {}
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if not match:
            continue
        version, name, direction = int(match[1]), match[2], match[3]
        slot = parts.setdefault(version, {"name": name})
        slot[direction] = entry.read_text()
    migrations = []
    for version in sorted(parts):
        slot = parts[version]
        if "up" not in slot or "down" not in slot:
            raise errors.MigrationError(f"migration {version:04d} lacks its up or down file")
        migrations.append(Migration(version, slot["name"], slot["up"], slot["down"]))
    for expected, migration in enumerate(migrations, start=1):
        if migration.version != expected:
            raise errors.MigrationError(
                f"migrations must be numbered 1, 2, 3...; found {migration.version} "
                f"where {expected} was expected"
            )
    return migrations


def plan(migrations: list[Migration], current: int, target: int | None = None) -> list[Step]:
    """Steps that move the schema from ``current`` to ``target`` (default: the newest)."""
    newest = migrations[-1].version if migrations else 0
    target = newest if target is None else target
    if not 0 <= target <= newest:
        raise errors.MigrationError(f"no migration {target}; versions go from 0 to {newest}")
    if current > newest:
        raise errors.MigrationError(
            f"the database is at version {current}, newer than this ALMA Stream ({newest}); "
            "upgrade ALMA Stream"
        )
    if target >= current:
        return [Step(m, "up") for m in migrations if current < m.version <= target]
    return [Step(m, "down") for m in reversed(migrations) if target < m.version <= current]


class Migrator:
    """Applies migrations to one database over an asyncpg connection."""

    def __init__(self, conn: asyncpg.Connection, migrations: list[Migration] | None = None) -> None:
        self._conn = conn
        self.migrations = load_migrations() if migrations is None else migrations

    async def _ensure_table(self) -> None:
        await self._conn.execute(
            f"""CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (
                    version    integer     PRIMARY KEY,
                    name       text        NOT NULL,
                    applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        # each applied version's floor, readable by workers that lack its file
        await self._conn.execute(
            f"ALTER TABLE {VERSION_TABLE} ADD COLUMN IF NOT EXISTS oldest_worker integer"
        )

    async def oldest_worker(self) -> int:
        """The oldest schema a worker may be built for and run on this database: the
        highest floor of the applied migrations (a row without one: its version)."""
        exists = await self._conn.fetchval("SELECT to_regclass($1) IS NOT NULL", VERSION_TABLE)
        if not exists:
            return 0
        has_column = await self._conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) "
            "AND attname = 'oldest_worker' AND NOT attisdropped)",
            VERSION_TABLE,
        )
        floor = "coalesce(oldest_worker, version)" if has_column else "version"
        return int(
            await self._conn.fetchval(f"SELECT coalesce(max({floor}), 0) FROM {VERSION_TABLE}")
        )

    async def current(self) -> int:
        exists = await self._conn.fetchval("SELECT to_regclass($1) IS NOT NULL", VERSION_TABLE)
        if not exists:
            return 0
        return int(
            await self._conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {VERSION_TABLE}")
        )

    async def status(self) -> list[MigrationStatus]:
        applied: dict[int, datetime] = {}
        if await self._conn.fetchval("SELECT to_regclass($1) IS NOT NULL", VERSION_TABLE):
            rows = await self._conn.fetch(f"SELECT version, applied_at FROM {VERSION_TABLE}")
            applied = {r["version"]: r["applied_at"] for r in rows}
        return [MigrationStatus(m.version, m.name, applied.get(m.version)) for m in self.migrations]

    async def migrate(self, target: int | None = None) -> list[Step]:
        """Move to ``target`` (default newest); returns the steps applied."""
        try:
            done: list[Step] = []
            while True:
                async with self._conn.transaction():
                    await self._conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
                    await self._ensure_table()
                    steps = plan(self.migrations, await self.current(), target)
                    if not steps:
                        return done
                    step = steps[0]
                    await self._conn.execute(step.sql)
                    if step.direction == "up":
                        await self._conn.execute(
                            f"INSERT INTO {VERSION_TABLE} (version, name, oldest_worker) "
                            "VALUES ($1, $2, $3)",
                            step.migration.version,
                            step.migration.name,
                            step.migration.oldest_worker,
                        )
                    else:
                        await self._conn.execute(
                            f"DELETE FROM {VERSION_TABLE} WHERE version = $1",
                            step.migration.version,
                        )
                done.append(step)
        except asyncpg.PostgresError as exc:
            raise errors.MigrationError(f"migration failed: {exc}") from exc
