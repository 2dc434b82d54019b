"""Rolling upgrades on the real services: a worker comes up alive before its
dependencies and waits, saying why, for a schema it needs; an old worker keeps
running on a newer schema that still admits it, and refuses, saying what to deploy,
one that does not.

The "newer release" is simulated by migrations this code does not ship, applied by a
Migrator given the shipped list plus them, as the next release's `alma db upgrade`
would apply its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import asyncpg
import pytest

from alma_core import errors
from alma_core.cli.embedded import free_port
from alma_core.consumers.worker import Services, WorkerStatus, run_worker
from alma_core.settings import Settings
from alma_core.storage.migrations import Migration, Migrator, load_migrations
from tests.integration.harness import Publisher, Worker, completed, count, wait_for
from tests.integration.test_http import get

SHIPPED = load_migrations()
NEWEST = len(SHIPPED)
ADDITIVE = Migration(
    NEWEST + 1,
    "future_notes",
    f"-- a release after this one adds a table\n-- oldest-worker: {NEWEST}\n"
    "CREATE TABLE future_notes (id bigint PRIMARY KEY, note text);",
    "DROP TABLE future_notes;",
)
DESTRUCTIVE = Migration(  # no oldest-worker line: admits only workers built for it
    NEWEST + 2,
    "future_drop",
    "ALTER TABLE future_notes DROP COLUMN note;",
    "ALTER TABLE future_notes ADD COLUMN note text;",
)


async def migrate(dsn: str, migrations: list[Migration], to: int | None = None) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await Migrator(conn, migrations).migrate(to)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def starting(settings: Settings) -> AsyncIterator[tuple[WorkerStatus, asyncio.Task[None]]]:
    """A checkpointer started without waiting for it to be ready."""
    assert settings.kafka_bootstrap
    assert settings.postgres_dsn
    assert settings.redis_url
    status, stop = WorkerStatus(), asyncio.Event()
    services = Services(settings.kafka_bootstrap, settings.postgres_dsn, settings.redis_url)
    run = run_worker(settings, services, ["checkpointer"], stop, status=status)
    task = asyncio.create_task(run)

    async def listening() -> bool:
        return status.http_port > 0 or task.done()

    await wait_for(listening, limit_s=10, what="the worker's HTTP endpoints")
    if task.done():
        task.result()
    try:
        yield status, task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def readiness(port: int) -> tuple[int, list[str]]:
    status, body = await get(port, "/readyz")
    return status, json.loads(body)["reasons"]


async def test_alive_before_postgres_answers_and_ready_names_what_is_missing(
    settings: Settings,
) -> None:
    closed = f"postgresql://alma:S3cretPW@127.0.0.1:{free_port()}/alma"
    async with starting(settings.model_copy(update={"postgres_dsn": closed})) as (status, _):

        async def retried() -> bool:
            _, reasons = await readiness(status.http_port)
            return any("unreachable (attempt" in r for r in reasons)

        assert (await get(status.http_port, "/healthz"))[0] == 200
        await wait_for(retried, limit_s=20, what="a failed connection attempt in /readyz")
        code, reasons = await readiness(status.http_port)
        assert code == 503
        assert [r for r in reasons if r.startswith("postgres: unreachable (attempt")], reasons
        assert "S3cretPW" not in json.dumps(reasons)
        assert (await get(status.http_port, "/healthz"))[0] == 200  # still alive


async def test_a_new_worker_waits_for_the_upgrade_then_runs(
    settings: Settings, empty_database: str
) -> None:
    """A pod of the new release that starts before the migration Job ran: alive, not
    ready, saying to run `alma db upgrade`; ready and working once it ran."""
    await migrate(empty_database, SHIPPED, NEWEST - 1)
    s = settings.model_copy(update={"postgres_dsn": empty_database})
    async with starting(s) as (status, task):

        async def waiting() -> bool:
            _, reasons = await readiness(status.http_port)
            return any(r.startswith("schema:") for r in reasons)

        await wait_for(waiting, limit_s=20, what="the schema reason in /readyz")
        code, reasons = await readiness(status.http_port)
        assert code == 503
        assert any(f"needs {NEWEST}: run `alma db upgrade`" in r for r in reasons), reasons
        assert not task.done()
        await migrate(empty_database, SHIPPED)

        async def ready() -> bool:
            return (await readiness(status.http_port))[0] == 200

        await wait_for(ready, limit_s=30, what="ready after the upgrade")
        async with Publisher(s.kafka_bootstrap or "", s.lifecycle_topic) as pub:
            await pub.send(completed("after-upgrade", updates={"x": 1}))
            await pub.flush()

        async def checkpointed() -> bool:
            return await count(empty_database, "SELECT count(*) FROM checkpoints") == 1

        await wait_for(checkpointed, what="the checkpoint")


async def test_an_old_worker_runs_on_a_newer_schema_that_admits_it(settings: Settings) -> None:
    dsn = settings.postgres_dsn or ""
    await migrate(dsn, [*SHIPPED, ADDITIVE])
    async with Worker.start(settings) as worker:
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            for i in range(3):
                await pub.send(completed("old-pod", updates={"i": i}))
            await pub.flush()

        async def checkpointed() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

        await wait_for(checkpointed, what="three checkpoints")
        assert (await get(worker.status.http_port, "/readyz"))[0] == 200

    # the next release drops what this one may still use: this worker must not start
    await migrate(dsn, [*SHIPPED, ADDITIVE, DESTRUCTIVE])
    with pytest.raises(errors.ConfigError, match=f"built for schema {NEWEST + 2} or later"):
        async with Worker.start(settings):
            pass

    # a rollback of the schema to what admits it brings it back
    await migrate(dsn, [*SHIPPED, ADDITIVE, DESTRUCTIVE], NEWEST + 1)
    async with Worker.start(settings) as worker:
        assert (await get(worker.status.http_port, "/readyz"))[0] == 200
