"""What every ``alma`` command shares: consoles, settings, service endpoints, and
turning ALMA errors into a message and an exit code."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import typer
from rich.console import Console

from alma_core import errors
from alma_core import settings as settings_mod
from alma_core.cli.embedded import Endpoints
from alma_core.storage import embeddings

out = Console()
err = Console(stderr=True)
T = TypeVar("T")

ENDPOINTS_FILE = settings_mod.ENDPOINTS_FILE


def run(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; turn ALMA errors into a message and exit code 1 (2 for settings)."""
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except errors.ConfigError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    except errors.AlmaError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None


def settings(**overrides: Any) -> settings_mod.Settings:
    """The command's settings. An ``alma`` process is ALMA Stream's own, so a model it
    loads may set torch's threads (``ALMA_EMBED_THREADS``) and silence progress bars."""
    try:
        loaded = settings_mod.load(**{k: v for k, v in overrides.items() if v is not None})
    except errors.ConfigError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    embeddings.configure_process(loaded.embed_threads)
    return loaded


def running_endpoints(s: settings_mod.Settings) -> dict[str, Any]:
    path = s.data_dir / ENDPOINTS_FILE
    if path.exists():
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    return {}


def _service(s: settings_mod.Settings, field: str, what: str) -> str:
    """A configured service, else the one a running `alma up` wrote down."""
    value = getattr(s, field) or running_endpoints(s).get(field)
    if not value:
        raise errors.ConfigError(
            f"no {what}: set ALMA_{field.upper()}, or start the embedded stack with `alma up` "
            f"(it writes {s.data_dir / ENDPOINTS_FILE})"
        )
    return str(value)


def dsn(s: settings_mod.Settings) -> str:
    return _service(s, "postgres_dsn", "database")


def redis_url(s: settings_mod.Settings) -> str:
    return _service(s, "redis_url", "Redis")


def bootstrap(s: settings_mod.Settings) -> str:
    return _service(s, "kafka_bootstrap", "Kafka")


async def connect(dsn: str) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        raise errors.StorageError(
            f"cannot connect to PostgreSQL at {dsn}: {exc}; check ALMA_POSTGRES_DSN "
            "or that `alma up` is running"
        ) from exc


def embed_url(s: settings_mod.Settings) -> str | None:
    """A worker's /embed: configured, else the running `alma up`'s (its learner's model)."""
    return s.embed_url or running_endpoints(s).get("embed_url")


def resolved(s: settings_mod.Settings, endpoints: Endpoints | None = None) -> settings_mod.Settings:
    """``s`` with every service filled in: from ``endpoints`` if given, else configured,
    else the running `alma up`'s."""
    served = s.embed_url
    if endpoints is None:
        endpoints = Endpoints(bootstrap(s), dsn(s), redis_url(s))
        served = embed_url(s)
    return s.model_copy(
        update={
            "kafka_bootstrap": endpoints.kafka_bootstrap,
            "postgres_dsn": endpoints.postgres_dsn,
            "redis_url": endpoints.redis_url,
            "embed_url": served,
        }
    )
