"""What every ``alma`` command shares: consoles, settings, service endpoints, the
tenant, and turning errors into one message and an exit code.

Exit codes (the command line's one rule): 0 done; 1 the operation failed, a service
unreachable included (the message says what to do next); 2 wrong usage or settings.
Everything shown to a person goes through :func:`alma_core.logs.redact`: no
password of a DSN or URL is ever printed."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import asyncpg
import typer
import typer.exceptions
from rich.console import Console
from rich.markup import escape

from alma_core import errors
from alma_core import settings as settings_mod
from alma_core.cli.embedded import Endpoints
from alma_core.logs import configure as configure_logs
from alma_core.logs import redact
from alma_core.messaging import acls
from alma_core.storage import embeddings, postgres
from alma_core.storage.cache import RedisCheckpointCache

UNWRAPPED = 100_000  # a pipe's width: tables as wide as their content, lines whole


def console(*, stderr: bool = False) -> Console:
    """A console for a person: a terminal's width there; piped (a file, ``grep``, a
    script), nothing wrapped, so ids and headers are never cut across lines."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=UNWRAPPED, soft_wrap=True)


def app(**options: Any) -> typer.Typer:
    """A command group. Its help is click's plain one: typer's rich help shows every
    flag with a type (``--json <bool>``) as if it took a value, and wraps in a pipe."""
    return typer.Typer(rich_markup_mode=None, **options)


def json_option(what: str = "the result") -> Any:
    """``--json``: ``what`` as one JSON document on stdout instead of a table."""
    return typer.Option(False, "--json", help=f"Print {what} as JSON, for scripts.")


out = console()
err = console(stderr=True)
T = TypeVar("T")

ENDPOINTS_FILE = settings_mod.ENDPOINTS_FILE
USAGE = 2  # wrong usage or settings
FAILED = 1  # the operation failed


def fail(message: str, code: int = FAILED) -> NoReturn:
    """Print ``message`` (passwords masked) as one error line, never wrapped (a terminal
    wraps it; a log keeps it whole), and exit with ``code``."""
    err.print(f"[red]error:[/red] {escape(redact(message))}", soft_wrap=True)
    raise typer.Exit(code)


def note(message: str) -> None:
    """A notice for a person on stderr (passwords masked)."""
    err.print(f"[yellow]note:[/yellow] {escape(redact(message))}", soft_wrap=True)


_debug = False  # ALMA_LOG_LEVEL=DEBUG: unexpected errors show their (masked) traceback


def run(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; an error becomes one line and an exit code: settings and usage
    (:class:`errors.ConfigError`, :class:`errors.ContextError`) 2, any other failure 1
    (:class:`errors.NotFound` included).
    An unexpected exception (a defect, or a malformed value a driver choked on) is one
    line too; its traceback, passwords masked, only with ``ALMA_LOG_LEVEL=DEBUG``."""
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except errors.NotFound as exc:  # asked right, not there: look again (1), not usage (2)
        fail(exc.message, FAILED)
    except (errors.ConfigError, errors.ContextError) as exc:
        fail(exc.message, USAGE)
    except errors.AlmaError as exc:
        fail(exc.message, FAILED)
    except asyncpg.InsufficientPrivilegeError as exc:  # a tenant's role (alma tenants role)
        fail(
            f"PostgreSQL refused it: {str(exc).rstrip('.')}. What to do: a tenant's own role "
            "reads its tenant's rows and writes only its reducers and its dead letters' "
            "replays; run this with ALMA's own credentials (ALMA_POSTGRES_DSN), or ask "
            "ALMA's operator",
            FAILED,
        )
    except (typer.Exit, typer.Abort, typer.exceptions.TyperException, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - one masked line instead of a traceback
        if _debug:
            err.print(redact("".join(traceback.format_exception(exc))), markup=False)
        fail(
            f"unexpected {type(exc).__name__}: {str(exc).rstrip('.')}. What to do: check "
            "the settings it names; otherwise run again with ALMA_LOG_LEVEL=DEBUG for the "
            "traceback and report it",
            FAILED,
        )


def settings(*, beside: bool = True, **overrides: Any) -> settings_mod.Settings:
    """The command's settings. An ``alma`` process is ALMA Stream's own, so a model it
    loads may set torch's threads (``ALMA_EMBED_THREADS``) and silence progress bars,
    and every log line of a library goes through the masking formatters (warnings and
    up; ``alma up``, ``alma worker`` and others set their own level). A command
    ``beside`` a secured ``alma up`` whose broker it uses connects as that stack's
    admin, with its tenant topics (:func:`alma_core.settings.secured_by`)."""
    try:
        loaded = settings_mod.load(**{k: v for k, v in overrides.items() if v is not None})
    except errors.ConfigError as exc:
        fail(exc.message, USAGE)
    if beside and loaded.kafka_bootstrap is None and (found := settings_mod.running(loaded)):
        loaded = settings_mod.secured_by(loaded, found.endpoints)
    global _debug
    _debug = loaded.log_level == "DEBUG"
    configure_logs(loaded.log_format, "DEBUG" if _debug else "WARNING")
    embeddings.configure_process(loaded.embed_threads)
    return loaded


def tenant(
    s: settings_mod.Settings, given: str | None, *, required: bool | None = None
) -> str | None:
    """The tenant a command acts for: ``--tenant``, else ``ALMA_TENANT``. Missing where
    it is required (``ALMA_REQUIRE_TENANT``, the default, or ``required``) is wrong
    usage: exit 2."""
    chosen = given or s.tenant
    needed = s.require_tenant if required is None else required
    if chosen is None and needed:
        why = "" if required else " (ALMA_REQUIRE_TENANT=true)"
        fail(f"a tenant is required{why}: pass --tenant T or set ALMA_TENANT", USAGE)
    return chosen


def running_endpoints(s: settings_mod.Settings) -> dict[str, Any]:
    """The services of the running `alma up` (``ALMA_DATA_DIR``, else found from here:
    :mod:`alma_core.stacks`); nothing when none runs."""
    found = settings_mod.running(s)
    return found.endpoints if found else {}


def _service(s: settings_mod.Settings, field: str, what: str) -> str:
    """A configured service, else the one a running `alma up` wrote down."""
    value = getattr(s, field) or running_endpoints(s).get(field)
    if not value:
        raise errors.ConfigError(
            f"no {what}: ALMA_{field.upper()} is not set and no `alma up` is running "
            f"({settings_mod.search(s).described()}). What to do: start the embedded stack "
            f"with `alma up` (in any directory), or set ALMA_{field.upper()}"
        )
    return str(value)


def dsn(s: settings_mod.Settings) -> str:
    return _service(s, "postgres_dsn", "database")


def redis_url(s: settings_mod.Settings) -> str:
    """The Redis URL (several for a Cluster; the settings check each port)."""
    return _service(s, "redis_url", "Redis")


async def forget_cached(s: settings_mod.Settings, runs: list[tuple[str, str]]) -> None:
    """Drop these runs, (tenant, run id) each, from the cache: their checkpoints went
    or changed. No Redis, or Redis down: a note (readers check every cached entry
    against PostgreSQL anyway)."""
    if not runs:
        return
    try:
        async with RedisCheckpointCache.for_settings(s, redis_url(s)) as cache:
            await cache.delete(runs)
    except (errors.CacheError, errors.ConfigError) as exc:
        note(f"cache not cleared: {exc.message}")


def bootstrap(s: settings_mod.Settings) -> str:
    return _service(s, "kafka_bootstrap", "Kafka")


async def connect(dsn: str) -> asyncpg.Connection:
    try:
        return await postgres.connect_first(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        raise errors.StorageError(
            f"cannot connect to PostgreSQL at {redact(dsn)}: {redact(str(exc))}. What to do: "
            "check ALMA_POSTGRES_DSN (host, port, user, password, database) and that the "
            "server is running, or start `alma up`"
        ) from exc
    except ValueError as exc:  # the driver could not parse the DSN
        raise errors.ConfigError(
            f"ALMA_POSTGRES_DSN={redact(dsn)!r} is malformed: {redact(str(exc))}; expected "
            "a URL such as postgresql://user@db.example:5432/alma"
        ) from exc


def kafka_unavailable(bootstrap: str, doing: str, exc: BaseException) -> errors.AlmaError:
    """Kafka failed while ``doing``: exit 1, with what to check. A refusal of the
    authorizer is :class:`errors.BrokerDenied` (an ACL is missing: no outage to wait
    out); anything else :class:`errors.BrokerUnavailable`."""
    if isinstance(exc, acls.REFUSALS):
        return errors.BrokerDenied(
            f"Kafka at {redact(bootstrap)} refused to {doing} ({type(exc).__name__}): this "
            "client's principal lacks an ACL for it. What to do: run it with credentials "
            "that may (an admin's for topics; ALMA_KAFKA_SASL_USERNAME/PASSWORD), or grant "
            "the ACL (`alma topics acls --role worker|orchestrator` prints each role's)"
        )
    return errors.BrokerUnavailable(
        f"cannot {doing} at {redact(bootstrap)}: {redact(repr(exc))}. What to do: check "
        "ALMA_KAFKA_BOOTSTRAP (and the ALMA_KAFKA_SECURITY_PROTOCOL/SASL/SSL settings) and "
        "that the broker is running, or start `alma up`"
    )


def embed_url(s: settings_mod.Settings) -> str | None:
    """A worker's /embed: configured, else the running `alma up`'s (its learner's model)."""
    return s.embed_url or running_endpoints(s).get("embed_url")


def resolved(s: settings_mod.Settings, endpoints: Endpoints | None = None) -> settings_mod.Settings:
    """``s`` with every service filled in: from ``endpoints`` if given, else configured,
    else the running `alma up`'s."""
    served = s.embed_url
    if endpoints is None:
        s = settings_mod.with_running(s)  # the running alma up's broker: its fetch wait too
        endpoints = Endpoints(bootstrap(s), dsn(s), redis_url(s))
        served = s.embed_url
    return s.model_copy(
        update={
            "kafka_bootstrap": endpoints.kafka_bootstrap,
            "postgres_dsn": endpoints.postgres_dsn,
            "redis_url": endpoints.redis_url,
            "embed_url": served,
        }
    )
