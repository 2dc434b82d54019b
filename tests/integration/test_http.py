"""A worker's /metrics, /healthz and /readyz over real HTTP; readiness follows PostgreSQL
and the brokers."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from alma_core.cli.embedded_kafka import KafkaBroker, default_libs
from alma_core.cli.topics import ensure_topics
from alma_core.consumers import http
from alma_core.settings import Settings, load
from alma_core.storage.embeddings import AsyncEmbedder
from tests.integration.conftest import TEST_PARTITIONS, PrivateStack, Topics, settings_for
from tests.integration.harness import Publisher, Worker, completed, count, wait_for
from tests.services import Services


async def get(port: int, path: str, accept: str | None = None) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    asked = f"Accept: {accept}\r\n" if accept else ""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{asked}\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split(" ")[1]), body


@pytest.mark.smoke
async def test_metrics_health_and_readiness(settings: Settings, worker: Worker) -> None:
    port = worker.status.http_port
    assert port > 0
    assert (await get(port, "/healthz"))[0] == 200
    status, body = await get(port, "/readyz")
    assert (status, json.loads(body)["ready"]) == (200, True), body
    assert (await get(port, "/nope"))[0] == 404
    dsn = settings.postgres_dsn
    assert dsn
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for i in range(3):
            await pub.send(completed("m", updates={"i": i}))
        await pub.send(b"garbage", key=b"m")
        await pub.flush()

    async def done() -> bool:
        return await count(dsn, "SELECT count(*) FROM dead_letters") == 1

    await wait_for(done, what="the events")
    await asyncio.sleep(0.2)
    _, text = await get(port, "/metrics")
    lines = {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln and not ln.startswith("#")
    }
    assert lines['alma_checkpoints_total{consumer="checkpointer",kind="node"}'] == 3
    assert lines['alma_dead_letters_total{consumer="checkpointer",reason="malformed_json"}'] == 1
    assert (
        lines[
            'alma_events_total{consumer="checkpointer",outcome="checkpointed",type="node.completed"}'
        ]
        == 3
    )
    assert not any("run_id" in k or '"m"' in k for k in lines), "no run ids as labels"


async def test_readiness_follows_postgres(private_stack: PrivateStack) -> None:
    async with Worker.start(private_stack.settings) as worker:
        port = worker.status.http_port
        assert (await get(port, "/readyz"))[0] == 200
        pg = private_stack.postgres
        pg_port = pg.port
        await pg.stop()
        status, body = await get(port, "/readyz")
        assert status == 503
        assert "postgres: not reachable" in json.loads(body)["reasons"]
        assert (await get(port, "/healthz"))[0] == 200  # alive, just not ready
        await pg.start(port=pg_port)

        async def ready_again() -> bool:
            return (await get(port, "/readyz"))[0] == 200

        await wait_for(ready_again, what="ready again")


async def test_readiness_follows_the_broker(
    services: Services, database: str, tmp_path: Path
) -> None:
    """A worker whose brokers are gone polls on (nothing comes) and must not look ready:
    a load balancer or a rollout would count it as serving (issue 73: /readyz answered
    200 through every broker outage). Apache Kafka of its own, killed and restarted."""
    broker = KafkaBroker(tmp_path / "kafka", tmp_path / "kafka-run", libs=default_libs())
    await broker.start()
    try:
        topics = Topics.fresh()
        await ensure_topics(broker.url, topics.all, partitions=TEST_PARTITIONS)
        settings = settings_for(broker.url, database, services.redis_url, topics, broker="kafka")
        async with Worker.start(settings) as worker:
            port = worker.status.http_port

            async def ready() -> bool:
                return (await get(port, "/readyz"))[0] == 200

            await wait_for(ready, what="ready")
            kafka_port = broker.port
            broker.kill()

            async def broker_missed() -> str:
                status, body = await get(port, "/readyz")
                return body if status == 503 else ""

            body = await wait_for(broker_missed, limit_s=30, what="not ready without a broker")
            assert "kafka: not reachable" in json.loads(body)["reasons"]
            assert (await get(port, "/healthz"))[0] == 200  # alive, just not ready
            await broker.start(port=kafka_port)
            await wait_for(ready, limit_s=60, what="ready again once the broker is back")
    finally:
        await broker.stop()


async def request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    status, _, text = data.decode().partition("\r\n\r\n")
    return int(status.split(" ")[1]), text


@pytest.mark.slow
async def test_a_worker_serves_its_model_and_retrieval_uses_it(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    """The learner's model answers ``POST /embed``: ``alma retrieve`` (and the SDK, the MCP
    server) embed the task there instead of loading the model, and load it themselves,
    saying so, when no worker answers."""
    from alma_core.storage.embeddings import ServedEmbedder
    from tests.integration.test_cli import alma
    from tests.integration.test_cli_runs import env_of
    from tests.integration.test_learner import WF, run_events

    dsn = settings.postgres_dsn or ""
    async with Worker.start(settings, ("checkpointer", "learner"), embedder) as worker:
        port = worker.status.http_port
        url = f"http://127.0.0.1:{port}/embed"
        texts = ["summarise graph database papers", "invoices in euros", "ünïcode ✓"]

        def no_local_model() -> AsyncEmbedder:
            raise AssertionError("the model was loaded though the worker answers")

        served = ServedEmbedder(url, no_local_model)
        assert await served.embed(texts) == await embedder.embed(texts)  # the same vectors
        assert (await request(port, "GET", "/embed"))[0] == 405
        assert (await request(port, "POST", "/embed", b'{"texts": []}'))[0] == 400
        assert (await request(port, "POST", "/embed", b"not json"))[0] == 400
        assert (await request(port, "POST", "/embed", b"x" * 300_000))[0] == 413
        async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
            for doc in run_events("served", fail_at="parse", message="bad tag at line 3"):
                await pub.send(doc)
            await pub.flush()

        async def learned() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 1

        await wait_for(learned, limit_s=60, what="the outcome")
        env = {**env_of(settings), "ALMA_EMBED_URL": url}
        ask = ("retrieve", "the parser fails on html", "--tenant", "acme", "--workflow", WF)
        found = await asyncio.to_thread(alma, *ask, "--json", env=env)
    assert found.returncode == 0, found.stderr
    assert "did not answer" not in found.stderr
    items = {i["run_id"] for i in json.loads(found.stdout)["items"] if i.get("run_id")}
    assert items == {"served"}
    gone = await asyncio.to_thread(alma, *ask, "--json", env=env)  # the worker stopped
    assert gone.returncode == 0, gone.stderr
    assert f"{url} did not answer" in " ".join(gone.stderr.split())
    assert {i["run_id"] for i in json.loads(gone.stdout)["items"] if i.get("run_id")} == items


def listening_on(port: int) -> set[str]:
    """The local addresses a socket listens on at ``port`` (IPv4), read from /proc."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


async def test_the_endpoints_listen_on_this_machine_only_unless_opened() -> None:
    """/metrics, the probes and /embed have no authentication: by default they answer
    on the loopback address alone; ALMA_METRICS_HOST opens them (a container, a pod)."""
    registry, health = CollectorRegistry(), http.Health()
    async with http.serve(0, registry, health, load().metrics_host) as port:
        assert listening_on(port) == {"127.0.0.1"}
    async with http.serve(0, registry, health, load(metrics_host="0.0.0.0").metrics_host) as port:
        assert listening_on(port) == {"0.0.0.0"}


async def test_a_slow_batch_leads_to_its_trace_through_an_exemplar() -> None:
    """A traced batch's latency carries its trace id as an exemplar, served to a
    Prometheus that asks for OpenMetrics (it stores exemplars); the classic text format
    has none."""
    from alma_core.consumers.metrics import Metrics

    metrics, health = Metrics(), http.Health()
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    metrics.batch_seconds.labels("checkpointer").observe(0.7, {"trace_id": trace_id})
    async with http.serve(0, metrics.registry, health) as port:
        status, open_metrics = await get(port, "/metrics", "application/openmetrics-text")
        assert status == 200
        _, classic = await get(port, "/metrics")
    bucket = next(
        line
        for line in open_metrics.splitlines()
        if line.startswith('alma_batch_seconds_bucket{consumer="checkpointer",le="1.0"}')
    )
    assert f'# {{trace_id="{trace_id}"}} 0.7' in bucket
    assert open_metrics.rstrip().endswith("# EOF")
    assert "alma_batch_seconds_bucket" in classic
    assert trace_id not in classic
