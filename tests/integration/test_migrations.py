"""Migrations on the real PostgreSQL: up, down, up again equals a fresh upgrade."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from alma_core import errors
from alma_core.storage.migrations import VERSION_TABLE, Migrator, load_migrations
from tests.integration.test_tenant_identity import TENANT_TABLES

CATALOG = {
    "columns": """SELECT table_name, column_name, data_type, udt_name, is_nullable,
                         column_default, is_identity
                  FROM information_schema.columns WHERE table_schema = 'public'
                  ORDER BY 1, 2""",
    "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes "
    "WHERE schemaname = 'public' ORDER BY 1, 2",
    "constraints": """SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
                      FROM pg_constraint WHERE connamespace = 'public'::regnamespace
                      ORDER BY 1, 2""",
    "policies": """SELECT tablename, policyname, roles::text, cmd, qual FROM pg_policies
                   WHERE schemaname = 'public' ORDER BY 1, 2""",
    "row_security": """SELECT relname, relrowsecurity FROM pg_class
                       WHERE relnamespace = 'public'::regnamespace AND relkind = 'r'
                       ORDER BY 1""",
    "vector_dims": """SELECT attrelid::regclass::text, attname, atttypmod FROM pg_attribute
                      WHERE atttypid = 'vector'::regtype AND attnum > 0 ORDER BY 1, 2""",
    "compression": """SELECT a.attrelid::regclass::text, a.attname, a.attcompression::text
                      FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                      WHERE c.relnamespace = 'public'::regnamespace
                        AND a.attcompression <> '' ORDER BY 1, 2""",
}


async def snapshot(conn: asyncpg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    return {name: [tuple(r) for r in await conn.fetch(sql)] for name, sql in CATALOG.items()}


async def test_upgrade_downgrade_upgrade_equals_fresh(empty_database: str, database: str) -> None:
    await assert_up_down_up(empty_database, database)


async def assert_up_down_up(empty_database: str, database: str) -> None:
    """Every migration up on an empty database, all down, all up again: the schema each
    time equals ``database``'s, migrated fresh."""
    newest = len(load_migrations())
    conn = await asyncpg.connect(empty_database)
    fresh = await asyncpg.connect(database)
    try:
        migrator = Migrator(conn)
        steps = await migrator.migrate()
        assert [s.migration.version for s in steps] == list(range(1, newest + 1))
        once = await snapshot(conn)
        assert await migrator.current() == newest

        down = await migrator.migrate(0)
        assert [s.direction for s in down] == ["down"] * newest
        assert await migrator.current() == 0
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> $1",
            VERSION_TABLE,
        )
        assert tables == []

        await migrator.migrate()
        assert await snapshot(conn) == once == await snapshot(fresh)
        assert ("workflow_outcomes", "embedding", 384) in once["vector_dims"]
        assert ("memories", "embedding", 384) in once["vector_dims"]
        # row-level security: retrieval's role on the learning tables (0002), a tenant's
        # own role on every table of tenants' rows (0022)
        assert {p[0] for p in once["policies"] if p[1] == "tenant_isolation"} == {
            "memories",
            "workflow_outcomes",
            "artifact_links",
        }
        assert {p[0] for p in once["policies"] if p[1] == "tenant_own"} == TENANT_TABLES
    finally:
        await conn.close()
        await fresh.close()


async def lz4_available(conn: asyncpg.Connection) -> bool:
    """Whether this server was built with lz4 (the probe is rolled back)."""
    probe = conn.transaction()
    await probe.start()
    try:
        await conn.execute("CREATE TEMP TABLE lz4_probe (x text COMPRESSION lz4)")
        return True
    except asyncpg.exceptions.FeatureNotSupportedError:
        return False
    finally:
        await probe.rollback()


async def test_states_are_compressed_with_lz4_where_the_server_has_it(database: str) -> None:
    """Migrations 0011, 0014 and 0024: a checkpoint's state (and a superseded one), an
    event's payload, a join's reply and a LangGraph blob take lz4 (cheaper than pglz to
    write) on a server built with it; on one without, they keep the default and the
    migrations still apply. 0016 changed four of these columns' type, which dropped
    their lz4: a server with lz4 (Debian's PostgreSQL 15, through
    ALMA_TEST_POSTGRES_DSN) fails this test without 0024."""
    conn = await asyncpg.connect(database)
    try:
        rows = await conn.fetch(
            """SELECT attrelid::regclass::text AS tbl, attname, attcompression::text AS c
               FROM pg_attribute
               WHERE (attrelid, attname) IN (('checkpoints'::regclass, 'state'),
                                             ('superseded_checkpoints'::regclass, 'state'),
                                             ('run_events'::regclass, 'payload'),
                                             ('joins'::regclass, 'reply'),
                                             ('graph_blobs'::regclass, 'blob'))
               ORDER BY 1"""
        )
        expected = "l" if await lz4_available(conn) else ""
        assert [(r["tbl"], r["attname"], r["c"]) for r in rows] == [
            ("checkpoints", "state", expected),
            ("graph_blobs", "blob", expected),
            ("joins", "reply", expected),
            ("run_events", "payload", expected),
            ("superseded_checkpoints", "state", expected),
        ]
        applied = {s.version for s in await Migrator(conn).status() if s.applied_at}
        assert {11, 14, 24} <= applied
    finally:
        await conn.close()


async def test_status_and_idempotent_upgrade(database: str) -> None:
    conn = await asyncpg.connect(database)
    try:
        migrator = Migrator(conn)
        assert await migrator.migrate() == []
        status = await migrator.status()
        assert status
        assert all(s.applied_at is not None for s in status)
        with pytest.raises(errors.MigrationError, match="no migration 99"):
            await migrator.migrate(99)
    finally:
        await conn.close()


async def test_concurrent_upgrades_apply_each_step_once(empty_database: str) -> None:
    import asyncio

    conns = [await asyncpg.connect(empty_database) for _ in range(3)]
    try:
        results = await asyncio.gather(*(Migrator(c).migrate() for c in conns))
        applied = sorted(s.migration.version for steps in results for s in steps)
        assert applied == list(range(1, len(load_migrations()) + 1))
    finally:
        for c in conns:
            await c.close()


async def test_runs_of_one_id_in_two_tenants_keep_their_data_and_block_going_below(
    empty_database: str,
) -> None:
    """0006 keys runs by tenant: it keeps the rows it finds, and going back below it is
    refused (naming the run) while two tenants share a run id, instead of losing one."""
    conn = await asyncpg.connect(empty_database)
    try:
        migrator = Migrator(conn)
        await migrator.migrate(5)
        await conn.execute(
            """INSERT INTO runs (run_id, tenant_id, workflow_id, last_seq)
                   VALUES ('r', 'acme', 'w', 1);
               INSERT INTO checkpoints (run_id, seq, tenant_id, kind, event_id, state, state_hash,
                   size_bytes) VALUES ('r', 1, 'acme', 'node', 'e1', '{}', 'h', 2);
               INSERT INTO run_heads (run_id, branch_key, seq, state_hash)
                   VALUES ('r', '', 1, 'h')"""
        )
        await migrator.migrate()
        heads = await conn.fetch("SELECT tenant_id, run_id, seq FROM run_heads")
        assert [tuple(r) for r in heads] == [("acme", "r", 1)]  # the tenant filled in
        await conn.execute(
            """INSERT INTO runs (run_id, tenant_id, workflow_id) VALUES ('r', 'globex', 'w')"""
        )
        with pytest.raises(errors.MigrationError, match="tenants share the run id r"):
            await migrator.migrate(5)
        # the migrations above 0006 went down one by one; 0006, which refused, is still applied
        assert await migrator.current() == 6
        runs = await conn.fetch("SELECT tenant_id, run_id FROM runs ORDER BY tenant_id")
        assert [tuple(r) for r in runs] == [("acme", "r"), ("globex", "r")]  # nothing lost
    finally:
        await conn.close()
