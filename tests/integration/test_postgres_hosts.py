"""A DSN whose first host hangs (it takes the connection and never answers, as a lost
machine's address does) still reaches the second host, a real PostgreSQL: the pool
and every connection ALMA opens give each host its own share of the timeout. asyncpg
alone spends the whole timeout on the first host (kept here as the reason)."""

from __future__ import annotations

import socket
import uuid

import asyncpg
import pytest

from alma_core.storage import postgres
from tests.integration.conftest import _drop_db, _with_db
from tests.services import Services


def with_silent_host_first(dsn: str, port: int) -> str:
    userinfo, _, rest = dsn.partition("@")
    return f"{userinfo}@127.0.0.1:{port},{rest}?target_session_attrs=read-write"


async def test_a_hanging_first_host_costs_its_share_of_the_timeout_not_all_of_it(
    database: str,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes handshakes; nothing ever answers
        dsn = with_silent_host_first(database, silent.getsockname()[1])
        with pytest.raises(TimeoutError):  # asyncpg alone never tries the second host
            await asyncpg.connect(dsn, timeout=2 * postgres.HOST_CONNECT_TIMEOUT_S)
        async with postgres.connect(dsn) as pool:  # its whole timeout: 10 s
            assert await pool.fetchval("SELECT count(*) FROM checkpoints") == 0
            assert await pool.fetchval("SELECT pg_is_in_recovery()") is False
        conn = await postgres.connect_first(dsn, timeout=2 * postgres.HOST_CONNECT_TIMEOUT_S)
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()


async def test_a_read_only_first_host_is_passed_over_for_the_writable_one(
    services: Services, oldest_postgres: str
) -> None:
    """A standby first in the list (a failed primary back as the new primary's standby)
    says it takes no writes: the next host is tried, as for a host that is gone. Here
    the "standby" is the suite's PostgreSQL with the database read-only, the primary
    PostgreSQL 15 (two servers, one database name)."""
    name = f"ro_{uuid.uuid4().hex[:10]}"
    readonly, writable = _with_db(services.postgres_dsn, name), _with_db(oldest_postgres, name)
    for admin_dsn in (services.postgres_dsn, oldest_postgres):
        admin = await asyncpg.connect(admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
    admin = await asyncpg.connect(services.postgres_dsn)
    try:
        await admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        both = f"{readonly.partition('/' + name)[0]},{writable.partition('@')[2]}"
        conn = await postgres.connect_first(f"{both}?target_session_attrs=read-write", timeout=10)
        try:
            assert (await conn.fetchval("SHOW server_version_num")).startswith("15")
        finally:
            await conn.close()
    finally:
        await admin.close()
        for admin_dsn in (services.postgres_dsn, oldest_postgres):
            await _drop_db(admin_dsn, name)
