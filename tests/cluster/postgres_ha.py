"""PostgreSQL as users run it for high availability: a primary and a streaming standby
on hosts of their own, each under Patroni, with etcd (on a host of its own) as the
store where Patroni keeps the leader key. When the primary's host dies, its key
expires after ``ttl`` seconds and the standby promotes itself; clients that name
both hosts with ``target_session_attrs=read-write`` find the new primary.

Why Patroni: it is what most PostgreSQL HA deployments run (its Kubernetes
operators included), it has synchronous replication as a switch of its dynamic
configuration (``synchronous_mode``), and Debian packages it with etcd. The
server is Debian's PostgreSQL 15 with pgvector (``make postgres15``), the oldest
PostgreSQL ALMA supports. Timings are shortened for the tests (``ttl`` 10 s,
``loop_wait`` 1 s, ``retry_timeout`` 3 s; Patroni's defaults are 30, 10 and 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from alma_core.cli.embedded_pg import PG_USER
from alma_core.cli.embedded_process import Service, port_open
from tests.cluster.hosts import Host

PG15 = Path("/usr/lib/postgresql/15/bin")
ETCD_PORT, PATRONI_PORT, POSTGRES_PORT = 2379, 8008, 5432
SCOPE = "alma"
TTL_S, LOOP_WAIT_S, RETRY_TIMEOUT_S = 10, 1, 3


def problem() -> str | None:
    """What this machine lacks for the HA PostgreSQL (None: nothing)."""
    if not (PG15 / "postgres").exists():
        return f"no PostgreSQL 15 in {PG15}. What to do: run `make postgres15`"
    for tool, package in (("patroni", "patroni"), ("etcd", "etcd-server")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed. What to do: apt-get install {package}"
    return None


def service_user() -> pwd.struct_passwd:
    """The system user PostgreSQL runs as (it refuses root): the embedded stack's."""
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", PG_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(PG_USER)


def owned_by_service_user(path: Path) -> None:
    """``path`` made and given to the service user, its parents made traversable."""
    user = service_user()
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, user.pw_uid, user.pw_gid)
    path.chmod(0o700)
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


def as_service_user(command: list[str]) -> list[str]:
    user = service_user()
    return [
        "setpriv",
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
        *command,
    ]


def http_json(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
    """A request to Patroni's REST API: (status, JSON body or None)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None


class Etcd(Service):
    """One etcd member: Patroni's store of the leader key."""

    name = "etcd"
    title = "etcd"

    def __init__(self, host: Host, data_dir: Path) -> None:
        super().__init__(data_dir.parent / "etcd-run")
        self.host = host
        self.data_dir = data_dir

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{ETCD_PORT}"

    def _command(self, port: int) -> list[str]:
        peer = f"http://{self.host.address}:{ETCD_PORT + 1}"
        return [
            *self.host.prefix,
            "etcd",
            "--name=e1",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=e1={peer}",
            "--log-level=warn",
        ]

    async def _ready(self) -> bool:
        status, _ = http_json(f"{self.url}/health")
        return bool(status == 200)

    async def start(self, port: int | None = None) -> None:
        await super().start(port or ETCD_PORT)


class PatroniNode(Service):
    """One PostgreSQL 15 node under Patroni (``ip netns exec`` its host, as the service
    user). ``start`` returns once its REST API answers; whether it leads or follows
    is Patroni's to decide (:meth:`role`)."""

    title = "PostgreSQL under Patroni"
    stop_signal = signal.SIGTERM  # Patroni stops its PostgreSQL, then itself

    def __init__(self, host: Host, root: Path, etcd: Etcd, subnet: str) -> None:
        self.name = f"patroni-{host.name}"
        super().__init__(root / "run")
        self.host = host
        self.root = root
        self.etcd = etcd
        self.subnet = subnet

    @property
    def api(self) -> str:
        return f"http://{self.host.address}:{PATRONI_PORT}"

    @property
    def url(self) -> str:
        return f"{self.host.address}:{POSTGRES_PORT}"

    def _config(self) -> dict[str, Any]:
        address = self.host.address
        return {
            "scope": SCOPE,
            "name": self.host.name,
            "log": {"level": "WARNING"},
            "restapi": {
                "listen": f"{address}:{PATRONI_PORT}",
                "connect_address": f"{address}:{PATRONI_PORT}",
            },
            "etcd3": {"hosts": f"{self.etcd.host.address}:{ETCD_PORT}"},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL_S,
                    "loop_wait": LOOP_WAIT_S,
                    "retry_timeout": RETRY_TIMEOUT_S,
                    "maximum_lag_on_failover": 16 * 1024 * 1024,
                    "synchronous_mode": False,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 200,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}],
            },
            "postgresql": {
                "listen": f"{address}:{POSTGRES_PORT}",
                "connect_address": f"{address}:{POSTGRES_PORT}",
                "data_dir": str(self.root / "data"),
                "bin_dir": str(PG15),
                "pgpass": str(self.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": "postgres", "password": "postgres"},
                },
                "pg_hba": [
                    f"host replication replicator {self.subnet} trust",
                    f"host all all {self.subnet} trust",
                    "local all all trust",
                ],
                "parameters": {
                    "unix_socket_directories": str(self.root / "socket"),
                    "shared_buffers": "64MB",
                },
            },
        }

    def _command(self, port: int) -> list[str]:
        del port
        for directory in (self.root, self.root / "socket"):
            owned_by_service_user(directory)
        config = self.root / "patroni.json"  # YAML is a superset of JSON
        config.write_text(json.dumps(self._config(), indent=1))
        os.chown(config, service_user().pw_uid, service_user().pw_gid)
        return [*self.host.prefix, *as_service_user(["patroni", str(config)])]

    def _popen_kwargs(self) -> dict[str, Any]:
        return {"cwd": str(self.root)}

    async def _ready(self) -> bool:
        if not port_open(PATRONI_PORT, self.host.address):
            return False
        status, _ = http_json(f"{self.api}/liveness")
        return bool(status == 200)

    def role(self) -> str | None:
        """``primary``, ``replica`` (streaming), or None (down, starting)."""
        try:
            status, doc = http_json(f"{self.api}/patroni")
        except OSError:
            return None
        if status != 200 or not doc or doc.get("state") != "running":
            return None
        return "primary" if doc.get("role") in ("master", "primary") else "replica"

    def die(self) -> None:
        """The host dies: off the network at once (a dead machine sends nothing more,
        not even the WAL a surviving backend still held), then Patroni and every
        PostgreSQL process of it SIGKILLed, until none is left (a postmaster may fork
        while its children are being killed). :meth:`start` brings it back."""
        self.host.cut_off()
        for _ in range(50):
            pids = subprocess.run(
                ["ip", "netns", "pids", self.host.netns],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)
        if self.proc is not None:
            self.proc.wait()
        self.proc = None

    async def start(self, port: int | None = None) -> None:
        self.host.reconnect()  # back on the network if it had died
        self.run_dir.mkdir(parents=True, exist_ok=True)
        await Service.start(self, PATRONI_PORT)


class PostgresHA:
    """etcd and two Patroni nodes: the DSN names both, and reaches the primary."""

    def __init__(self, etcd: Etcd, nodes: list[PatroniNode]) -> None:
        self.etcd = etcd
        self.nodes = nodes

    @property
    def services(self) -> list[Service]:
        return [self.etcd, *self.nodes]

    def dsn(self, database: str) -> str:
        hosts = ",".join(n.url for n in self.nodes)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    async def start(self) -> None:
        await self.etcd.start()
        await asyncio.gather(*(n.start() for n in self.nodes))
        await self.wait_roles()

    def primary(self) -> PatroniNode | None:
        found = [n for n in self.nodes if n.role() == "primary"]
        return found[0] if len(found) == 1 else None

    async def wait_roles(self, limit_s: float = 120) -> float:
        """Until one node leads and every other streams from it; seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            roles = sorted(str(n.role()) for n in self.nodes)
            if roles == ["primary", *["replica"] * (len(self.nodes) - 1)] and self._streaming():
                return time.monotonic() - started
            await asyncio.sleep(0.5)
        raise AssertionError(
            f"PostgreSQL's nodes have not settled in {limit_s} s: "
            f"{[(n.host.name, n.role()) for n in self.nodes]}; logs: "
            f"{[str(n.log_path) for n in self.nodes]}"
        )

    def _streaming(self) -> bool:
        primary = self.primary()
        if primary is None:
            return False
        _, doc = http_json(f"{primary.api}/cluster")
        members = (doc or {}).get("members", [])
        followers = [m for m in members if m.get("role") != "leader"]
        return len(followers) == len(self.nodes) - 1 and all(
            m.get("state") in ("streaming", "running") for m in followers
        )

    async def set_synchronous(self, on: bool, limit_s: float = 60) -> None:
        """Patroni's ``synchronous_mode``: a commit returns once the standby has it."""
        primary = self.primary()
        assert primary is not None, "no primary to configure"
        status, _ = http_json(f"{primary.api}/config", "PATCH", {"synchronous_mode": on})
        assert status == 200, f"Patroni refused synchronous_mode={on}: {status}"
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            _, doc = http_json(f"{primary.api}/cluster")
            roles = [m.get("role") for m in (doc or {}).get("members", [])]
            if ("sync_standby" in roles) == on:
                return
            await asyncio.sleep(0.5)
        raise AssertionError(f"no synchronous standby after {limit_s} s" if on else "still sync")

    async def wait_promoted(self, old: PatroniNode, limit_s: float = 90) -> float:
        """Until a node other than ``old`` leads; seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            primary = self.primary()
            if primary is not None and primary is not old:
                return time.monotonic() - started
            await asyncio.sleep(0.2)
        raise AssertionError(f"no standby promoted within {limit_s} s")

    async def wait_everywhere(self, database: str, limit_s: float = 30) -> None:
        """Until every node has ``database`` (just created on the primary): asyncpg tries
        the DSN's hosts in order, and a standby without it ends the attempt with
        "database does not exist" instead of trying the next host."""
        import asyncpg

        started = time.monotonic()
        for node in self.nodes:
            host, port = node.url.split(":")
            while True:
                try:
                    conn = await asyncpg.connect(
                        host=host, port=int(port), user="postgres", database=database, timeout=2
                    )
                    await conn.close()
                    break
                except (OSError, asyncpg.PostgresError, TimeoutError):
                    if time.monotonic() - started > limit_s:
                        raise
                    await asyncio.sleep(0.2)
