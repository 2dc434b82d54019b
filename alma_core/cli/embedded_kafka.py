"""Apache Kafka as the embedded broker: one KRaft process (broker and controller in
one JVM) on free loopback ports, its log on disk in ``data_dir`` so that a restart,
after a clean stop or a SIGKILL, comes back with every record it acknowledged.

* **Jars**: the broker and its dependencies, copied by Maven from the pom beside this
  module (``kafka/pom.xml``, which names the version) into :func:`default_libs`:
  ``make kafka`` runs :func:`fetch_command`. Nothing is downloaded at run time.
* **First start**: the data directory is formatted (``kafka.tools.StorageTool
  format``) with a new cluster id, kept in ``meta.properties``; every later start
  reads it back, so offsets stored in PostgreSQL stay valid (they are keyed by it).
* **Ports**: chosen free at each start and written into ``server.properties``; a
  restart by the supervisor asks for the same client port (the controller's port is
  the broker's own business and chosen again).
* **Ready**: the broker answers ``describe_cluster`` with its own cluster id (a
  taken port or another broker is never mistaken for it).
* Settings for one node on a developer's machine, each a difference from a
  production cluster written down in docs/kafka.md: replication 1, the internal
  topics with 4 partitions (50 by default: slow to create on 2 cores), no
  auto-creation of topics, no delay before a group's first rebalance, group
  session timeouts from 1 s (the tests use 2 s), and a 2 s broker session (a
  restart after a SIGKILL waits for the dead one's to expire: 9 s by default).
"""

from __future__ import annotations

import asyncio
import base64
import re
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alma_core import errors
from alma_core.cli.embedded_process import Service, free_port, port_open, write_private

HERE = Path(__file__).with_name("kafka")
POM = HERE / "pom.xml"
LOG_CONFIG = HERE / "log4j2.yaml"
MIN_JAVA = 17  # Kafka 4's broker needs Java 17 or newer
DEFAULT_HEAP_MB = 512
MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"
FORMAT_TIMEOUT_S = 120.0


def version() -> str:
    """The Apache Kafka version the pom names (the one place it is written)."""
    found = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    assert found, f"{POM} names no <kafka.version>"
    return found.group(1)


def default_libs() -> Path:
    """Where ``make kafka`` puts the broker's jars (shared by every clone and stack)."""
    return Path.home() / ".cache" / "alma-stream" / f"kafka-{version()}"


def fetch_command(libs: Path) -> list[str]:
    """The Maven command that copies the broker's jars into ``libs`` (``make kafka``)."""
    return [
        "mvn",
        "-B",
        "-q",
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={libs}",
    ]


def java_major(java: str) -> int | None:
    """The major version of the ``java`` at that path (None: it does not run)."""
    try:
        shown = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        ).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', shown)
    if not found:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major  # "1.8" is Java 8


def problem(libs: Path) -> str | None:
    """Why Apache Kafka cannot start here, with what to do; None: it can."""
    java = shutil.which("java")
    if java is None:
        return (
            f"Apache Kafka needs Java {MIN_JAVA} or newer and no `java` is on PATH. What to "
            f"do: install a JDK or JRE {MIN_JAVA}+ (Debian: apt-get install "
            "openjdk-17-jre-headless), or use the in-memory broker (ALMA_EMBEDDED_BROKER=tansu)"
        )
    major = java_major(java)
    if major is None or major < MIN_JAVA:
        return (
            f"Apache Kafka needs Java {MIN_JAVA} or newer; {java} is "
            f"{'unusable' if major is None else f'Java {major}'}. What to do: put a Java "
            f"{MIN_JAVA}+ first on PATH, or use the in-memory broker (ALMA_EMBEDDED_BROKER=tansu)"
        )
    if not any(libs.glob("kafka_2.13-*.jar")):
        return (
            f"Apache Kafka {version()}'s jars are not in {libs}. What to do: run `make kafka` "
            f"(Maven copies them there: {' '.join(fetch_command(libs))}), or set "
            "ALMA_KAFKA_LIBS to a folder that holds them"
        )
    return None


async def answers_as(
    port: int, cluster_id: str, options: dict[str, Any] | None = None, host: str = "127.0.0.1"
) -> bool:
    """Whether the broker on ``host:port`` is the one of ``cluster_id``: a port taken by
    another program or broker, or a broker still starting, is not."""
    from aiokafka.admin import AIOKafkaAdminClient

    if not port_open(port, host):
        return False
    admin = AIOKafkaAdminClient(
        bootstrap_servers=f"{host}:{port}", request_timeout_ms=2000, **(options or {})
    )
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    return bool(cluster.get("cluster_id") == cluster_id)


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (Kafka's Uuid)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


BROKER_PRINCIPAL = "CN=alma-broker"  # the subject of the broker's certificate


@dataclass(frozen=True)
class Security:
    """SASL/SCRAM-SHA-512 over TLS, with Kafka's own authorizer (StandardAuthorizer,
    nothing allowed that no ACL allows): the users and their passwords, the first the
    broker's own (a super user, which grants the others' ACLs), and the server's
    certificate and unencrypted PKCS#8 key (PEM), issued for 127.0.0.1 to
    :data:`BROKER_PRINCIPAL`, for servers and clients (it is the broker's identity on
    its controller's mutual-TLS listener)."""

    users: dict[str, str]
    certificate: Path
    key: Path
    ca: Path  # what signed ``certificate``: how clients verify the broker

    def client_options(self, user: str) -> dict[str, Any]:
        """aiokafka's keyword arguments to connect as ``user``."""
        from aiokafka.helpers import create_ssl_context

        return {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": user,
            "sasl_plain_password": self.users[user],
            "ssl_context": create_ssl_context(cafile=str(self.ca)),
        }

    @property
    def admin(self) -> str:
        return next(iter(self.users))

    def scram_arguments(self) -> list[str]:
        """``kafka.tools.StorageTool format``'s arguments that store the users."""
        out: list[str] = []
        for user, password in self.users.items():
            out += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
        return out

    def properties(self, keystore: Path) -> dict[str, str]:
        admin = self.admin
        jaas = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{admin}" password="{self.users[admin]}";'
        )
        return {
            # the controller's listener (loopback) is mutual TLS: the broker's own
            # certificate is its client identity there, and nothing else gets in
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "listener.name.controller.ssl.client.auth": "required",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(keystore),
            # the broker checks, at start, that a client trusting this CA could connect
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            # the broker's own connections: to itself as the admin, to its controller
            # by its certificate (the principal Kafka reads from it: its subject)
            "super.users": f"User:{admin};User:{BROKER_PRINCIPAL}",
            "allow.everyone.if.no.acl.found": "false",
        }


class KafkaBroker(Service):
    """Apache Kafka in KRaft mode, one process, its log kept in ``data_dir``."""

    name = "broker"
    title = "Kafka broker (Apache Kafka)"
    kind = "kafka"
    in_memory = False  # its log is on disk: a restart keeps every acknowledged record
    # SIGTERM, Kafka's own stop signal: a JVM started with SIGINT ignored (what a
    # non-interactive shell does to a job it puts in the background: `alma up &`, a
    # script, CI) ignores SIGINT, and was killed after the grace instead of shutting down
    stop_signal = signal.SIGTERM

    def __init__(
        self,
        data_dir: Path,
        run_dir: Path,
        *,
        libs: Path,
        heap_mb: int = DEFAULT_HEAP_MB,
        security: Security | None = None,
    ) -> None:
        super().__init__(run_dir)
        self.data_dir = data_dir.resolve()
        self.libs = libs
        self.heap_mb = heap_mb
        self.security = security
        self.cluster_id = ""
        self.controller_port = 0

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "log"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int | None = None) -> None:
        found = problem(self.libs)
        if found:
            raise errors.StackError(found)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.cluster_id = self._stored_cluster_id() or await self._format()
        await super().start(port)

    def _stored_cluster_id(self) -> str | None:
        try:
            text = (self.log_dir / "meta.properties").read_text()
        except OSError:
            return None
        found = re.search(r"^cluster\.id=(\S+)$", text, re.MULTILINE)
        return found.group(1) if found else None

    async def _format(self) -> str:
        """Format the (new) log directory under a new cluster id, once."""
        cluster_id = self._new_cluster_id()
        self._write_config(free_port(), free_port())
        # one argument: an id may begin with "-" (base64), which argparse takes for an option
        command = [*self._java(), STORAGE_TOOL, "format", f"--cluster-id={cluster_id}"]
        command += ["-c", str(self.config_path)]
        if self.security is not None:
            command += self.security.scram_arguments()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        done = await asyncio.to_thread(
            subprocess.run,
            command,
            capture_output=True,
            text=True,
            timeout=FORMAT_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise errors.StackError(
                f"formatting Apache Kafka's log directory {self.log_dir} failed:\n"
                f"{(done.stdout + done.stderr)[-2000:]}\nWhat to do: read the lines above; "
                f"remove {self.data_dir} to start a new broker"
            )
        return cluster_id

    def _new_cluster_id(self) -> str:
        """The id a new log directory is formatted with (a cluster's nodes share one)."""
        return new_cluster_id()

    def _java(self) -> list[str]:
        java = shutil.which("java") or "java"
        return [
            java,
            f"-Xmx{self.heap_mb}m",
            f"-Xms{min(self.heap_mb, 128)}m",
            # Kafka's own launcher's collector settings (kafka-run-class.sh)
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent",
            "-XX:+ExitOnOutOfMemoryError",
            "-XX:-UsePerfData",  # no hsperfdata file kept up to date for jstat
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG_CONFIG}",
            "-cp",
            f"{self.libs}/*",
        ]

    def _write_config(self, port: int, controller_port: int) -> None:
        self.controller_port = controller_port
        host = "127.0.0.1"
        settings = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{host}:{controller_port}",
            "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://{host}:{port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.log_dir),
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "group.min.session.timeout.ms": "1000",
            # A restart after a SIGKILL waits for the dead incarnation's session to
            # expire before the broker serves (9 s by default); the heartbeat within it
            # (each wakes the controller: 500 ms idled the JVM at 6.3 % of a core with the
            # no-op records below, 1 s at 5.0 %; docs/kafka.md)
            "broker.session.timeout.ms": "3000",
            "broker.heartbeat.interval.ms": "1000",
            # the controller's no-op record every 500 ms (KIP-835) tells brokers of other
            # nodes that the metadata log is alive; one node in one process needs none,
            # and each is a write and a wake-up of every metadata reader
            "metadata.max.idle.interval.ms": "0",
            "log.retention.hours": "168",
            # the log cleaner (for __consumer_offsets) takes its whole dedupe buffer from
            # the heap at start: 128 MiB by default, a quarter of DEFAULT_HEAP_MB; 16 MiB
            # holds ~600,000 keys per cleaning pass, far more than one stack's groups
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
        }
        if self.security is not None:
            keystore = self.data_dir / "keystore.pem"  # Kafka's PEM keystore: key, then chain
            write_private(
                keystore, self.security.key.read_bytes() + self.security.certificate.read_bytes()
            )
            scheme = "SASL_SSL"
            settings |= self.security.properties(keystore)
            settings["listeners"] = settings["listeners"].replace("PLAINTEXT://", f"{scheme}://", 1)
            settings["advertised.listeners"] = f"{scheme}://{host}:{port}"
        text = "".join(f"{k}={v}\n" for k, v in settings.items())
        # it holds the admin's password when secured: its owner's only
        # (one written by an older release, 0644, is replaced)
        header = "# Written by alma up at each start (alma_core/cli/embedded_kafka.py)\n"
        write_private(self.config_path, header + text)

    def _command(self, port: int) -> list[str]:
        self._write_config(port, free_port())
        return [*self._java(), MAIN_CLASS, str(self.config_path)]

    async def _ready(self) -> bool:
        options = {} if self.security is None else self.security.client_options(self.security.admin)
        return await answers_as(self.port, self.cluster_id, options)

    def _advice(self) -> str:
        return (
            f"a damaged log directory can be removed ({self.log_dir}: its records are lost) "
            "to start a new broker"
        )
