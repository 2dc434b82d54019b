"""The topology users deploy, as hosts on one machine: three Apache Kafka brokers
(``k1``-``k3``), PostgreSQL as a primary and a standby under Patroni (``pg1``, ``pg2``,
with etcd on ``etcd``: :mod:`tests.cluster.postgres_ha`), Redis (``cache``), two
worker hosts running ``alma worker`` (``w1``, ``w2``) and an orchestrator host
publishing with the SDK (``o1``). :func:`cluster` starts it and removes all of it
afterwards (processes, namespaces, links), also when the test fails;
:meth:`Cluster.fresh` gives each scenario its own database, topics, consumer groups
and cache prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient

from alma_core.cli.embedded_kafka import default_libs, new_cluster_id
from alma_core.cli.embedded_process import Service
from alma_core.cli.topics import ensure_topics
from alma_core.settings import Settings, load
from alma_core.storage.migrations import Migrator
from tests.cluster.hosts import Host, Network
from tests.cluster.postgres_ha import Etcd, PatroniNode, PostgresHA
from tests.cluster.services import ClusterBroker, HostRedis
from tests.integration.harness import WorkerProcess

PARTITIONS = 6
WORKER_HOSTS = ("w1", "w2")


@dataclass
class Cluster:
    network: Network
    brokers: dict[int, ClusterBroker]
    postgres: PostgresHA
    redis: HostRedis
    root: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return ",".join(b.url for b in self.brokers.values())

    def host(self, name: str) -> Host:
        return self.network.hosts[name]

    async def fresh(self, name: str) -> Settings:
        """Settings of a scenario of its own: a migrated database, topics replicated on
        three brokers, group ids and a cache prefix nobody else uses."""
        database = f"s_{re.sub(r'[^a-z0-9]', '_', name)}_{uuid.uuid4().hex[:6]}"
        admin = await asyncpg.connect(self.postgres.dsn("postgres"))
        try:
            await admin.execute(f'CREATE DATABASE "{database}"')
        finally:
            await admin.close()
        await self.postgres.wait_everywhere(database)
        dsn = self.postgres.dsn(database)
        conn = await asyncpg.connect(dsn)
        try:
            await Migrator(conn).migrate()
            await conn.execute(
                "INSERT INTO reducer_configs (tenant_id, workflow_id, config) VALUES ($1, $2, $3)",
                "acme",
                "ha",
                json.dumps({"reducers": {"history": "append"}}),
            )
        finally:
            await conn.close()
        tag = uuid.uuid4().hex[:8]
        settings = load(
            kafka_bootstrap=self.bootstrap,
            postgres_dsn=dsn,
            redis_url=self.redis.url,
            lifecycle_topic=f"lifecycle-{tag}",
            merged_topic=f"merged-{tag}",
            dlq_topic=f"dlq-{tag}",
            sequenced_topic=f"sequenced-{tag}",
            redis_prefix=f"c{tag}",
            group_prefix=f"c{tag}",
            partitions=PARTITIONS,
            replication_factor=3,
            kafka_idempotence=True,
        )
        await ensure_topics(
            self.bootstrap,
            [
                settings.lifecycle_topic,
                settings.merged_topic,
                settings.dlq_topic,
                settings.sequenced_topic,
            ],
            partitions=PARTITIONS,
            replication_factor=3,
        )
        return settings

    async def start_workers(
        self, settings: Settings, consumers: str = "checkpointer,joiner"
    ) -> None:
        for name in WORKER_HOSTS:
            log = self.root / f"{name}-{settings.group_prefix}.log"
            worker = WorkerProcess(settings, log, consumers, prefix=self.host(name).prefix)
            # each worker host's own name in its groups, as docs/operations.md deploys
            # them: a restarted worker takes its partitions back without a rebalance
            worker.env["ALMA_GROUP_INSTANCE_ID"] = name
            self.workers.append(worker.start())
        for worker in self.workers:
            await worker.wait_started(90)

    def stop_workers(self) -> None:
        for worker in self.workers:
            if worker.proc and worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)  # a frozen one stops only thawed
            worker.terminate(30)
        self.workers.clear()

    def orchestrate(
        self, settings: Settings, out: Path, runs: int, seconds: float, rate: float, joins: int
    ) -> subprocess.Popen[bytes]:
        """The orchestrator host publishing (:mod:`tests.cluster.orchestrator`): ``runs``
        runs of nodes and ``joins`` runs that fan out and join."""
        from tests.integration.harness import worker_env

        with (self.root / f"o1-{settings.group_prefix}.log").open("ab") as log:
            return subprocess.Popen(
                [
                    *self.host("o1").prefix,
                    sys.executable,
                    "-m",
                    "tests.cluster.orchestrator",
                    str(out),
                    str(runs),
                    str(seconds),
                    str(rate),
                    str(joins),
                ],
                env=worker_env(settings),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=Path(__file__).parents[2],
            )

    async def readiness(self, host: str) -> int:
        """The HTTP status of ``/readyz`` of the worker on ``host`` (asked from inside
        the host: a worker's endpoints listen on its loopback); 0 when it does not
        answer."""
        port = self.workers[0].env.get("ALMA_METRICS_PORT", "9464")
        code = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            f"    r = urllib.request.urlopen('http://127.0.0.1:{port}/readyz', timeout=5)\n"
            "    print(r.status)\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code)\n"
            "except OSError:\n"
            "    print(0)\n"
        )
        proc = await asyncio.create_subprocess_exec(
            *self.host(host).prefix,
            sys.executable,
            "-c",
            code,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        return int(out.decode().strip() or 0)

    async def partitions(self, topic: str) -> list[dict[str, Any]]:
        """The brokers' description of each partition of ``topic`` (leader, ISR)."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=5000)
        await admin.start()
        try:
            described = await admin.describe_topics([topic])
        finally:
            await admin.close()
        return list(described[0]["partitions"])

    async def leaders(self, topic: str) -> dict[int, int]:
        """Partition -> the node id leading it."""
        return {p["partition"]: p["leader"] for p in await self.partitions(topic)}

    async def under_replicated(self, topic: str) -> int:
        return sum(1 for p in await self.partitions(topic) if len(p["isr"]) < 3)

    def active_controller(self) -> int:
        """The KRaft quorum's leader, as the nodes' own quorum-state files say (the
        one with the highest epoch is current)."""
        best = (-1, -1)
        for broker in self.brokers.values():
            path = broker.log_dir / "__cluster_metadata-0" / "quorum-state"
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(path.read_text())
                if state.get("leaderId", -1) >= 0:
                    best = max(best, (state["leaderEpoch"], state["leaderId"]))
        if best[1] < 0:
            raise AssertionError("no node names a quorum leader")
        return best[1]

    async def wait_replicated(self, topic: str, limit_s: float = 60) -> float:
        """Until every partition of ``topic`` has its three replicas in sync; seconds."""
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            with contextlib.suppress(Exception):
                if await self.under_replicated(topic) == 0:
                    return time.monotonic() - started
            await asyncio.sleep(0.5)
        raise AssertionError(f"{topic} still under-replicated after {limit_s} s")


@contextlib.asynccontextmanager
async def cluster(root: Path) -> AsyncIterator[Cluster]:
    """Start the topology, yield it, remove all of it."""
    network = Network()
    started: list[Service] = []
    made: Cluster | None = None
    try:
        names = ("k1", "k2", "k3", "etcd", "pg1", "pg2", "cache", *WORKER_HOSTS, "o1")
        hosts = {n: network.add(n) for n in names}
        voters = {i: hosts[f"k{i}"] for i in (1, 2, 3)}
        cluster_id = new_cluster_id()
        brokers = {
            i: ClusterBroker(h, i, voters, cluster_id, root / f"k{i}", libs=default_libs())
            for i, h in voters.items()
        }
        etcd = Etcd(hosts["etcd"], root / "etcd" / "data")
        subnet = str(network.subnet)
        postgres = PostgresHA(
            etcd, [PatroniNode(hosts[n], root / n, etcd, subnet) for n in ("pg1", "pg2")]
        )
        redis = HostRedis(hosts["cache"], root / "cache")
        started.extend([*brokers.values(), *postgres.services, redis])
        await asyncio.gather(
            *(b.start(9092) for b in brokers.values()), postgres.start(), redis.start()
        )
        made = Cluster(network, brokers, postgres, redis, root)
        yield made
    finally:
        if made is not None:
            made.stop_workers()
        for service in started:  # what they hold is thrown away: no need to wait
            service.kill()
        network.close()
