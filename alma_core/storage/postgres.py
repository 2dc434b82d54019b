"""The PostgreSQL edge: a pool with JSON codecs, and asyncpg errors mapped to ours.

What counts as PostgreSQL's failure: an error asyncpg raises, and an OS-level error
(a reset connection, a timeout) raised while talking to PostgreSQL, i.e. from asyncpg's
own code. The same ``ConnectionResetError`` raised by other code that runs while a
transaction is open (an application's reducer with a socket of its own) is that code's
failure: it is isolated to its record like any other defect, not waited out as an
outage with every partition paused.

Retriable: anything about the server's state rather than the data — the connection
or the server went away, a deadlock or serialization failure, too many connections,
a full disk or out of memory (SQLSTATE class 53), an operator's shutdown (57), an
internal error (58, XX), a read-only server after a failover (25006), a lock that was
not granted in time (55P03). The consumers pause and retry those; nothing is
dead-lettered for them. Anything else PostgreSQL says is about the data and is
:class:`errors.StorageRejected` (a retry would fail the same way).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import asyncpg
from asyncpg import exceptions as pgx

from alma_core import errors
from alma_core.schemas import jsoncodec

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
# the driver's own state machine gave up on a connection (a server killed while it read
# an error): the pool replaces the connection, a retry goes on
_DRIVER = (asyncpg.InterfaceError, asyncpg.InternalClientError)
_RETRIABLE_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58", "XX")
_RETRIABLE_SQLSTATES = ("25006", "55P03", "55006")


def _server_state(exc: BaseException) -> bool:
    """True when PostgreSQL's error code says the server, not the data, is at fault."""
    code = getattr(exc, "sqlstate", None)
    if not isinstance(exc, asyncpg.PostgresError) or not isinstance(code, str):
        return False
    return code[:2] in _RETRIABLE_SQLSTATE_CLASSES or code in _RETRIABLE_SQLSTATES


def storage_error(exc: BaseException, doing: str) -> errors.StorageError:
    """Our error for an asyncpg/OS failure while ``doing`` something."""
    if isinstance(exc, (*_RETRIABLE_PG, *_RETRIABLE_OS, *_DRIVER)) or _server_state(exc):
        return errors.StorageError(f"PostgreSQL unavailable while {doing}: {exc!r}")
    return errors.StorageRejected(f"PostgreSQL refused {doing}: {exc!r}")


STORAGE_FAILURES: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    *_DRIVER,
    *_RETRIABLE_OS,
)


def is_storage_failure(exc: BaseException) -> bool:
    """True when ``exc`` is PostgreSQL's failure (see the module docstring)."""
    if isinstance(exc, (asyncpg.PostgresError, *_DRIVER)):
        return True
    return isinstance(exc, _RETRIABLE_OS) and _raised_by_driver(exc)


def _raised_by_driver(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it came from, passed through asyncpg's code."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            module = str(tb.tb_frame.f_globals.get("__name__", ""))
            if module == "asyncpg" or module.startswith("asyncpg."):
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


def _encode_json(value: Any) -> str:
    # Callers pass pre-serialised JSON text to avoid encoding large states twice.
    return value if isinstance(value, str) else jsoncodec.compact(value).decode()


def _decode_json(text: str) -> Any:
    return jsoncodec.parse(text.encode())


async def _init_connection(conn: asyncpg.Connection) -> None:
    for type_name in ("jsonb", "json"):
        await conn.set_type_codec(
            type_name, encoder=_encode_json, decoder=_decode_json, schema="pg_catalog"
        )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A connection goes back to the pool as it is: nothing sent on a pooled connection
    outlives its transaction (docs/operations.md, "PostgreSQL connections";
    ``tests/unit/test_pooled_sessions.py`` keeps it so)."""


def columns(rows: Iterable[Sequence[Any]], width: int) -> list[list[Any]]:
    """Rows as ``width`` parallel arrays, the parameters of ``unnest($1, $2, ...)``
    (``width`` empty arrays for no rows)."""
    arrays = [list(column) for column in zip(*rows, strict=True)]
    return arrays or [[] for _ in range(width)]


# How long a connection waits for one of a DSN's hosts before it tries the next. asyncpg
# spends its one timeout on the whole list, host after host: a host that is gone without a
# word (a lost machine: no reset, no refusal) took all of it, and the next host, the
# promoted standby, was never tried (tests/cluster, a lost PostgreSQL primary).
HOST_CONNECT_TIMEOUT_S = 5.0


def host_dsns(dsn: str) -> list[str]:
    """``dsn`` once for each of its hosts, in order, all else kept (its database, user,
    ``target_session_attrs``); a DSN of one host is itself."""
    scheme, sep, rest = dsn.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    hosts = hostlist.split(",")
    if not sep or len(hosts) < 2:
        return [dsn]
    return [f"{scheme}://{userinfo}{at}{host}{slash}{tail}" for host in hosts]


# The host of each multi-host DSN that last took a connection: tried first next time, so
# after a failover only the first connection pays for the lost host's timeout.
_last_good: dict[str, str] = {}


async def connect_first(dsn: str, **kwargs: Any) -> asyncpg.Connection:
    """``asyncpg.connect`` to the first of the DSN's hosts that answers and has the
    ``target_session_attrs`` asked for, each host given :data:`HOST_CONNECT_TIMEOUT_S`
    of the whole ``timeout``, the host that last answered first; the last host's error
    when none does. One host: asyncpg's own connect. The pool's and every connection's
    way in (``connect`` of :func:`create_pool`)."""
    targets = host_dsns(dsn)
    if len(targets) == 1:
        return await asyncpg.connect(dsn, **kwargs)
    last = _last_good.get(dsn)
    if last in targets:
        targets.remove(last)
        targets.insert(0, last)
    whole = float(kwargs.pop("timeout", 60.0))
    failure: BaseException | None = None
    for target in targets:
        try:
            conn: asyncpg.Connection = await asyncpg.connect(
                target, timeout=min(whole, HOST_CONNECT_TIMEOUT_S), **kwargs
            )
        except (
            OSError,
            TimeoutError,
            asyncpg.PostgresError,  # starting, shutting down, behind (no such database yet)
            asyncpg.InterfaceError,
            pgx.TargetServerAttributeNotMatched,  # a standby, where writes were asked for
        ) as exc:
            failure = exc  # the next host may do
            continue
        _last_good[dsn] = target
        return conn
    assert failure is not None
    raise failure


async def create_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 8,
    lock_timeout_ms: int = 10_000,
    idle_in_transaction_timeout_ms: int = 60_000,
    generic_plans: bool = False,
) -> asyncpg.Pool:
    """A pool for ``dsn``; a failure to connect names the DSN and what to check.

    No wait is unbounded: a lock not granted within ``lock_timeout_ms`` is an error the
    consumers back off from and retry (55P03, retriable), and PostgreSQL ends a
    session left idle inside a transaction for ``idle_in_transaction_timeout_ms`` (a
    member that stalled mid-batch), which releases the locks it held on its
    partitions' offsets. 0 turns either off. ``generic_plans``: each prepared statement
    is planned once, not at each execution (a worker's: its batch statements, keyed by
    arrays of primary keys, whose plans the values do not change; docs/benchmarks.md)."""
    plans = {"plan_cache_mode": "force_generic_plan"} if generic_plans else {}
    try:
        pool: asyncpg.Pool = await asyncpg.create_pool(
            dsn,
            connect=connect_first,
            min_size=min_size,
            max_size=max_size,
            init=_init_connection,
            reset=_keep_session,
            timeout=10,
            command_timeout=60,  # nothing waits forever on a server that went away
            server_settings={
                "application_name": "alma-stream",
                "lock_timeout": str(lock_timeout_ms),
                "idle_in_transaction_session_timeout": str(idle_in_transaction_timeout_ms),
                **plans,
            },
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
async def connect(
    dsn: str, *, min_size: int = 1, max_size: int = 8, generic_plans: bool = False
) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(dsn, min_size=min_size, max_size=max_size, generic_plans=generic_plans)
    try:
        yield pool
    finally:
        await pool.close()
