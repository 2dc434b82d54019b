"""The cluster's services, each on a host of its own (:mod:`tests.cluster.hosts`): the
embedded stack's classes, told where to run and which address to listen on.

* :class:`ClusterBroker`: one node of a three-node Apache Kafka cluster (KRaft, each
  node a broker and a controller), the topology users deploy: replication factor 3,
  ``min.insync.replicas=2``, no unclean leader election. Heaps and threads sized so
  three brokers, PostgreSQL, Redis and the workers fit a 2-core machine.
* :class:`HostRedis`: the embedded Redis, listening on its host's address (PostgreSQL
  is :mod:`tests.cluster.postgres_ha`'s).

Each is a :class:`~alma_core.cli.embedded_process.Service`: ``start``, ``stop``,
``kill`` (SIGKILL), and readiness polled from the test's namespace over the bridge.
"""

from __future__ import annotations

from pathlib import Path

from alma_core.cli import embedded_kafka
from alma_core.cli.embedded import Redis
from alma_core.cli.embedded_kafka import KafkaBroker
from alma_core.cli.embedded_process import Service
from tests.cluster.hosts import Host

KAFKA_PORT, CONTROLLER_PORT = 9092, 9093
REDIS_PORT = 6379
BROKER_HEAP_MB = 256

# What the cluster's brokers differ in from Kafka's defaults, and why (docs/operations.md,
# "High availability", says which of these users should set the same way).
CLUSTER_SETTINGS = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "unclean.leader.election.enable": "false",  # a lagging replica never becomes leader
    "offsets.topic.replication.factor": "3",
    "offsets.topic.num.partitions": "4",  # 50 by default: slow to create on 2 cores
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    "auto.create.topics.enable": "false",
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "1000",
    # How long the controller waits for a broker's heartbeat before it moves the
    # leadership of its partitions (9 s by default): the pause a dead leader costs
    "broker.session.timeout.ms": "3000",
    "broker.heartbeat.interval.ms": "500",
    # How long a follower that stopped fetching stays in the ISR (30 s by default): while
    # a cut-off follower is in it, acks=all writes to its partitions wait
    "replica.lag.time.max.ms": "6000",
    # The log cleaner (for __consumer_offsets) takes its whole dedupe buffer from the
    # heap as the broker starts: 128 MiB by default, half of BROKER_HEAP_MB, which now
    # and then left no room and the broker died of OutOfMemoryError before it served.
    # 16 MiB holds ~600,000 keys per cleaning pass, many times the groups' offsets here.
    "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
    "num.network.threads": "2",
    "num.io.threads": "2",
    "num.replica.fetchers": "1",
    "background.threads": "2",
    "log.retention.hours": "168",
}


class ClusterBroker(KafkaBroker):
    """Node ``node_id`` of the cluster whose nodes are ``voters`` (node id -> host)."""

    def __init__(
        self,
        host: Host,
        node_id: int,
        voters: dict[int, Host],
        cluster_id: str,
        data_dir: Path,
        *,
        libs: Path,
    ) -> None:
        super().__init__(data_dir, data_dir / "run", libs=libs, heap_mb=BROKER_HEAP_MB)
        self.name = f"kafka-{node_id}"
        self.log_path = self.run_dir / f"{self.name}.log"
        self.host = host
        self.node_id = node_id
        self.voters = voters
        self.shared_cluster_id = cluster_id

    @property
    def url(self) -> str:
        return f"{self.host.address}:{KAFKA_PORT}"

    def _new_cluster_id(self) -> str:
        return self.shared_cluster_id

    def _write_config(self, port: int, controller_port: int) -> None:
        del port, controller_port  # a host of its own: the usual ports
        address = self.host.address
        voters = ",".join(f"{n}@{h.address}:{CONTROLLER_PORT}" for n, h in self.voters.items())
        settings = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{address}:{KAFKA_PORT},CONTROLLER://{address}:{CONTROLLER_PORT}",
            "advertised.listeners": f"PLAINTEXT://{address}:{KAFKA_PORT}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.log_dir),
            **CLUSTER_SETTINGS,
        }
        self.config_path.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))

    def _command(self, port: int) -> list[str]:
        self._write_config(port, CONTROLLER_PORT)
        return [*self.host.prefix, *self._java(), embedded_kafka.MAIN_CLASS, str(self.config_path)]

    async def _ready(self) -> bool:
        return await embedded_kafka.answers_as(KAFKA_PORT, self.cluster_id, host=self.host.address)

    async def restart(self) -> None:
        """Start again on its data (after a kill or a stop)."""
        await Service.start(self, KAFKA_PORT)


class HostRedis(Redis):
    """The embedded Redis on ``host``: a cache that may be lost (no persistence)."""

    def __init__(self, host: Host, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.host = host

    def _command(self, port: int) -> list[str]:
        command = super()._command(port)
        command[command.index("--bind") + 1] = self.host.address
        return [*self.host.prefix, *command]

    @property
    def url(self) -> str:
        return f"redis://{self.host.address}:{self.port}/0"

    async def start(self, port: int | None = None) -> None:
        await super().start(port or REDIS_PORT)
