"""Where the integration tests get their real services, in this order:

1. already running ones named by ``ALMA_TEST_KAFKA_BOOTSTRAP``,
   ``ALMA_TEST_POSTGRES_DSN`` and ``ALMA_TEST_REDIS_URL`` (each on its own);
2. containers from testcontainers, when a Docker engine answers;
3. the embedded processes (``alma_core.cli.embedded``), started here.

The suite's broker is Apache Kafka (``ALMA_TEST_BROKER=kafka``, the default: the
broker users deploy), embedded from ``make kafka``'s jars; ``ALMA_TEST_BROKER=tansu``
runs it on Tansu instead. Tests that are about one broker ask for it by name
(:func:`broker_stack`). A service is never skipped: if none of the three works, the
session fails with the reason.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from alma_core.cli.embedded import EmbeddedStack

# The registry of running `alma up` stacks (ALMA_STACKS_DIR): the suite keeps its own,
# so a developer's running stack is never found by a test, nor a test's by a developer.
KEPT_SETTINGS = ("ALMA_STACKS_DIR",)


def without_alma_settings() -> dict[str, str]:
    """This process's environment without its ``ALMA_`` settings (for a command run as
    a user would), the suite's registry of running stacks kept."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ALMA_") or k in KEPT_SETTINGS}


@dataclass
class Services:
    kafka_bootstrap: str
    postgres_dsn: str  # a maintenance DSN: tests create their own databases from it
    redis_url: str
    source: dict[str, str] = field(default_factory=dict)
    stack: EmbeddedStack | None = None


def _docker_reachable() -> bool:
    """Ask the engine's /_ping over its socket (the docker library leaks a socket on failure)."""
    import socket
    from urllib.parse import urlparse

    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    url = urlparse(host)
    try:
        if url.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = url.path
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            address = (url.hostname or "localhost", url.port or 2375)
        with sock:
            sock.settimeout(2)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(64)
    except OSError:
        return False


BrokerKind = Literal["kafka", "tansu"]


def suite_broker() -> BrokerKind:
    """The broker the suite runs on (``ALMA_TEST_BROKER``: kafka, the default, or tansu)."""
    wanted = os.environ.get("ALMA_TEST_BROKER", "kafka")
    if wanted not in ("kafka", "tansu"):
        raise ValueError(f"ALMA_TEST_BROKER={wanted!r}: expected kafka or tansu")
    return "kafka" if wanted == "kafka" else "tansu"


@contextlib.asynccontextmanager
async def broker_stack(tmp_dir: Path, kind: BrokerKind) -> AsyncIterator[EmbeddedStack]:
    """One embedded broker of ``kind`` alone (no PostgreSQL, no Redis), stopped after."""
    stack = EmbeddedStack(
        tmp_dir, postgres_dsn="given", redis_url="given", durable=False, broker=kind
    )
    await stack.start()
    try:
        yield stack
    finally:
        await stack.stop()


@contextlib.asynccontextmanager
async def real_services(tmp_dir: Path) -> AsyncIterator[Services]:
    given = {
        "kafka": os.environ.get("ALMA_TEST_KAFKA_BOOTSTRAP"),
        "postgres": os.environ.get("ALMA_TEST_POSTGRES_DSN"),
        "redis": os.environ.get("ALMA_TEST_REDIS_URL"),
    }
    source = {name: "environment" for name, value in given.items() if value}
    containers: list[Any] = []
    if not all(given.values()) and _docker_reachable():
        given, started = _start_containers(given)
        containers.extend(started)
        source.update({name: "testcontainers" for name in given if name not in source})
    stack = EmbeddedStack(
        tmp_dir,
        kafka_bootstrap=given["kafka"],
        postgres_dsn=given["postgres"],
        redis_url=given["redis"],
        durable=False,
        broker=suite_broker(),
    )
    try:
        endpoints = await stack.start()
        source.update({name: "embedded" for name in given if name not in source})
        yield Services(
            kafka_bootstrap=endpoints.kafka_bootstrap,
            postgres_dsn=endpoints.postgres_dsn,
            redis_url=endpoints.redis_url,
            source=source,
            stack=stack,
        )
    finally:
        await stack.stop()
        for container in containers:
            with contextlib.suppress(Exception):
                container.stop()


def _start_containers(given: dict[str, str | None]) -> tuple[dict[str, str | None], list[Any]]:
    out = dict(given)
    started: list[Any] = []
    if not out["kafka"]:
        from testcontainers.kafka import KafkaContainer

        kafka = KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft()
        kafka.start()
        started.append(kafka)
        out["kafka"] = kafka.get_bootstrap_server()
    if not out["postgres"]:
        from testcontainers.postgres import PostgresContainer

        pg = PostgresContainer("pgvector/pgvector:pg17", driver=None)
        pg.start()
        started.append(pg)
        out["postgres"] = pg.get_connection_url()
    if not out["redis"]:
        from testcontainers.redis import RedisContainer

        redis = RedisContainer("redis:7")
        redis.start()
        started.append(redis)
        host, port = redis.get_container_host_ip(), redis.get_exposed_port(6379)
        out["redis"] = f"redis://{host}:{port}/0"
    return out, started
