"""Migration files and planning (pure; the database side is an integration test)."""

from __future__ import annotations

import pytest

from alma_core import errors
from alma_core.storage.migrations import Migration, compatibility, load_migrations, plan

M = [Migration(v, f"m{v}", f"up{v}", f"down{v}") for v in (1, 2, 3)]


def test_shipped_migrations_are_numbered_and_paired() -> None:
    migrations = load_migrations()
    assert [m.version for m in migrations] == list(range(1, len(migrations) + 1))
    assert all(m.up.strip() and m.down.strip() for m in migrations)


def test_plan_up_from_scratch() -> None:
    assert [(s.migration.version, s.direction) for s in plan(M, 0)] == [
        (1, "up"),
        (2, "up"),
        (3, "up"),
    ]


def test_plan_partial_up_and_down() -> None:
    assert [s.sql for s in plan(M, 1, 2)] == ["up2"]
    assert [s.sql for s in plan(M, 3, 1)] == ["down3", "down2"]
    assert plan(M, 2, 2) == []


def test_plan_refuses_unknown_targets_and_newer_databases() -> None:
    with pytest.raises(errors.MigrationError, match="no migration 9"):
        plan(M, 0, 9)
    with pytest.raises(errors.MigrationError, match="newer than this ALMA Stream"):
        plan(M, 5)


def test_a_migration_declares_the_oldest_worker_it_admits() -> None:
    additive = Migration(9, "notes", "-- 0009 notes\n-- oldest-worker: 7\nCREATE TABLE x ();", "")
    assert additive.oldest_worker == 7
    assert Migration(9, "drop", "ALTER TABLE x DROP COLUMN y;", "").oldest_worker == 9
    # the line must stand alone: a mention inside other text declares nothing
    mention = Migration(9, "m", "-- see oldest-worker: 3 in the docs\nSELECT 1;", "")
    assert mention.oldest_worker == 9


def test_compatibility_of_a_worker_with_a_schema() -> None:
    assert compatibility(8, 8, 8) is None
    assert compatibility(8, 9, 8) is None  # a newer, additive schema: old pods keep running
    older = compatibility(8, 7, 7)
    assert older is not None
    assert "run `alma db upgrade`" in older
    too_old = compatibility(8, 10, 10)
    assert too_old is not None
    assert "admits workers built for schema 10 or later" in too_old
    assert "built for 8" in too_old


def test_shipped_migrations_admit_no_worker_older_than_themselves_unless_declared() -> None:
    """Every floor is at most the migration's own version (a floor above it would
    refuse the very workers that ship it)."""
    for migration in load_migrations():
        assert migration.oldest_worker <= migration.version, migration.name
