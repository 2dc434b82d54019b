"""The PostgreSQL edge: a pool with JSON codecs, and asyncpg errors mapped to ours.

Retriable: the connection or the server went away, a deadlock or serialization
failure, too many connections. Anything else PostgreSQL says about the data is
:class:`errors.StorageRejected` (a retry would fail the same way).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from asyncpg import exceptions as pgx

from alma_core import errors

_RETRIABLE_PG = (
    pgx.PostgresConnectionError,
    pgx.CannotConnectNowError,
    pgx.TooManyConnectionsError,
    pgx.AdminShutdownError,
    pgx.CrashShutdownError,
    pgx.SerializationError,
    pgx.DeadlockDetectedError,
    pgx.QueryCanceledError,
    pgx.ConnectionDoesNotExistError,
)
_RETRIABLE_OS = (OSError, TimeoutError, asyncpg.InterfaceError, ConnectionError)


def storage_error(exc: BaseException, doing: str) -> errors.StorageError:
    """Our error for an asyncpg/OS failure while ``doing`` something."""
    if isinstance(exc, (*_RETRIABLE_PG, *_RETRIABLE_OS)):
        return errors.StorageError(f"PostgreSQL unavailable while {doing}: {exc!r}")
    return errors.StorageRejected(f"PostgreSQL refused {doing}: {exc!r}")


STORAGE_FAILURES: tuple[type[BaseException], ...] = (asyncpg.PostgresError, *_RETRIABLE_OS)


def is_storage_failure(exc: BaseException) -> bool:
    return isinstance(exc, STORAGE_FAILURES)


def _encode_json(value: Any) -> str:
    # Callers pass pre-serialised JSON text to avoid encoding large states twice.
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


async def _init_connection(conn: asyncpg.Connection) -> None:
    for type_name in ("jsonb", "json"):
        await conn.set_type_codec(
            type_name, encoder=_encode_json, decoder=json.loads, schema="pg_catalog"
        )


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 8) -> asyncpg.Pool:
    """A pool for ``dsn``; a failure to connect names the DSN and what to check."""
    try:
        pool: asyncpg.Pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            init=_init_connection,
            timeout=10,
            command_timeout=60,  # nothing waits forever on a server that went away
        )
    except Exception as exc:
        if is_storage_failure(exc):
            raise errors.StorageError(
                f"cannot connect to PostgreSQL at {dsn}: {exc}; check ALMA_POSTGRES_DSN "
                "and that the server is up"
            ) from exc
        raise
    return pool


@contextlib.asynccontextmanager
async def connect(dsn: str, *, min_size: int = 1, max_size: int = 8) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(dsn, min_size=min_size, max_size=max_size)
    try:
        yield pool
    finally:
        await pool.close()
