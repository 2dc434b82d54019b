"""Migration files and planning (pure; the database side is an integration test)."""

from __future__ import annotations

import pytest

from alma_core import errors
from alma_core.storage.migrations import Migration, load_migrations, plan

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
