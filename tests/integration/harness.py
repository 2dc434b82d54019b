"""Helpers for integration tests: events, a publisher, workers in-process or as
processes, bounded waits, and queries of what ALMA Stream stored."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from alma_core import replay as replaying
from alma_core.consumers.metrics import Metrics
from alma_core.consumers.worker import Services as WorkerServices
from alma_core.consumers.worker import WorkerStatus, run_worker
from alma_core.reducers import default_registry
from alma_core.settings import Settings
from alma_core.storage import replays
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.postgres import connect
from tests.services import without_alma_settings

T = TypeVar("T")


def event(
    type_: str,
    run_id: str,
    *,
    tenant: str = "acme",
    workflow: str = "wf",
    node: str | None = "n",
    branch: str | None = None,
    event_id: str | None = None,
    **payload: Any,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "event_id": event_id or uuid.uuid4().hex,
        "type": type_,
        "emitted_at": datetime.now(UTC).isoformat(),
        "tenant_id": tenant,
        "workflow_id": workflow,
        "run_id": run_id,
        "payload": payload,
    }
    if node is not None:
        doc["node_id"] = node
    if branch is not None:
        doc["branch_id"] = branch
    return doc


def completed(run_id: str, **kw: Any) -> dict[str, Any]:
    return event("node.completed", run_id, **kw)


def finished(run_id: str, nodes: int, task: str, **kw: Any) -> dict[str, Any]:
    """A run's ``workflow.completed``: ``nodes`` nodes, all succeeded."""
    return event(
        "workflow.completed",
        run_id,
        node=None,
        outcome="success",
        duration_ms=10,
        node_count=nodes,
        nodes_succeeded=nodes,
        nodes_failed=0,
        task=task,
        **kw,
    )


class Publisher:
    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=12 * 1024 * 1024
        )

    async def __aenter__(self) -> Publisher:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def send(
        self,
        doc: dict[str, Any] | bytes,
        key: str | bytes | None = None,
        *,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Queue one record; ``flush`` waits for all of them."""
        value = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        if key is None and isinstance(doc, dict):
            key = doc["run_id"]
        key_bytes = key.encode() if isinstance(key, str) else key
        await self.producer.send(self.topic, value, key=key_bytes, headers=headers)

    async def flush(self) -> None:
        await self.producer.flush()


async def wait_for(
    check: Callable[[], Awaitable[T]], *, limit_s: float = 60, what: str = "condition"
) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {limit_s}s waiting for {what}; last value: {last!r}")


async def count(dsn: str, sql: str, *args: Any) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(sql, *args))
    finally:
        await conn.close()


def plan_nodes(node: dict[str, Any]) -> Any:
    """Every node of an ``EXPLAIN (FORMAT JSON)`` plan, depth first."""
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child)


async def fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    for kind in ("json", "jsonb"):
        await conn.set_type_codec(kind, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
    try:
        rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
        return rows
    finally:
        await conn.close()


async def register_reducers(dsn: str, workflow: str, reducers: dict[str, str]) -> None:
    """What `alma reducers set` will do: a workflow's reducer configuration, ahead of time."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO reducer_configs (tenant_id, workflow_id, config) VALUES ($1, $2, $3)",
            "acme",
            workflow,
            json.dumps({"reducers": reducers}),
        )
    finally:
        await conn.close()


async def read_topic(
    bootstrap: str, topic: str, expected: int, *, limit_s: float = 30
) -> list[Any]:
    """Read ``expected`` records from the start of ``topic`` (fails after ``limit_s``)."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[Any] = []
    try:
        deadline = time.monotonic() + limit_s
        while len(records) < expected and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            for rs in batch.values():
                records.extend(rs)
    finally:
        await consumer.stop()
    assert len(records) >= expected, f"{topic}: {len(records)} of {expected} records"
    return records


class Worker:
    """A worker running in this process, stopped gracefully at the end."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.status = WorkerStatus()

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        settings: Settings,
        consumers: tuple[str, ...] = ("checkpointer",),
        embedder: AsyncEmbedder | None = None,
    ) -> AsyncIterator[Worker]:
        worker = cls(settings, Metrics())
        ready = asyncio.Event()
        assert settings.kafka_bootstrap
        assert settings.postgres_dsn
        assert settings.redis_url
        services = WorkerServices(
            settings.kafka_bootstrap, settings.postgres_dsn, settings.redis_url
        )
        worker.task = asyncio.create_task(
            run_worker(
                settings,
                services,
                list(consumers),
                worker.stop,
                metrics=worker.metrics,
                ready=ready,
                status=worker.status,
                embedder=embedder,
            )
        )
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait([worker.task, waiter], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if worker.task.done():
            worker.task.result()
        assert ready.is_set(), "the worker did not start within 60 s"
        try:
            yield worker
        finally:
            worker.stop.set()
            await asyncio.wait_for(worker.task, 60)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def worker_env(settings: Settings) -> dict[str, str]:
    """The environment that makes `alma worker` use these settings."""
    env = without_alma_settings()
    return env | settings.to_env() | {"ALMA_LOG_FORMAT": "json"}


class WorkerProcess:
    """`alma worker` as a separate process, for SIGKILL and restarts; ``prefix`` runs
    it elsewhere (``ip netns exec HOST``: a worker host of the cluster tests)."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path,
        consumers: str = "checkpointer",
        *,
        prefix: list[str] | None = None,
    ) -> None:
        self.env = worker_env(settings)
        self.log_path = log_path
        self.consumers = consumers
        self.prefix = prefix or []
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    def start(self) -> WorkerProcess:
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self.prefix,
                    sys.executable,
                    "-m",
                    "alma_core.cli",
                    "worker",
                    "--consumers",
                    self.consumers,
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def log_since_start(self) -> str:
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    async def wait_started(self, limit_s: float = 60) -> None:
        """Until this start of the process has its services and starts its consumers: by
        then its cache writer has bumped the Redis epoch, which makes every entry written
        before unreachable. (Its endpoints come up earlier, before any service answers.)"""

        async def listening() -> bool:
            assert self.alive, f"worker exited:\n{self.log_since_start()[-3000:]}"
            return '"consumers_starting"' in self.log_since_start()

        await wait_for(listening, limit_s=limit_s, what=f"{self.log_path.name} to start")

    def terminate(self, timeout: float = 30) -> int | None:
        """SIGTERM, then the exit code; SIGKILL (-9) after ``timeout`` s, with the log
        tail printed so a failing test shows where the worker hung."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"--- {self.log_path.name} did not stop in {timeout} s; its log tail:")
                print(self.log_since_start()[-4000:])
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


async def assert_exactly_once(dsn: str, published: dict[str, list[dict[str, Any]]]) -> None:
    """Every run's checkpoints are exactly its published events, once, in publish order,
    with seq 1..n (the events published carry distinct states)."""
    rows = await fetch(dsn, "SELECT run_id, seq, event_id FROM checkpoints ORDER BY run_id, seq")
    by_run: dict[str, list[tuple[int, str]]] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append((r["seq"], r["event_id"]))
    assert set(by_run) == set(published)
    for run, docs in published.items():
        got = by_run[run]
        assert [seq for seq, _ in got] == list(range(1, len(got) + 1)), f"{run}: seq gap"
        assert [eid for _, eid in got] == [d["event_id"] for d in docs], f"{run}: order/once"
    assert await assert_replays_the_same(dsn) >= len(published)


async def assert_replays_the_same(dsn: str, *, tenant: str | None = None) -> int:
    """Every run (of ``tenant``) folded again through today's pure core, as `alma replay`
    does, makes exactly the checkpoints stored. Returns how many runs were replayed."""
    replayed = 0
    async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
        async for tenant_id, run_id in replays.chosen(conn, tenant_id=tenant):
            inputs = await replays.load(conn, tenant_id, run_id)
            assert inputs is not None
            assert inputs.skipped is None, (run_id, inputs.skipped)
            verdict = replaying.replay(
                inputs.run,
                inputs.events,
                inputs.stored,
                config=inputs.config,
                registry=default_registry(),
                max_state_bytes=10_000_000,
            )
            assert verdict.difference is None, verdict.to_doc()
            replayed += 1
    return replayed


async def assert_cache_matches(
    settings: Settings, runs: list[str], *, require_all: bool, tenant: str = "acme"
) -> int:
    """The cached latest checkpoint of each of the tenant's runs is PostgreSQL's (never
    older). Returns how many runs were served from the cache."""
    from alma_core.storage.cache import RedisCheckpointCache
    from alma_core.storage.postgres import connect
    from alma_core.storage.reader import CheckpointReader

    assert settings.postgres_dsn
    assert settings.redis_url
    hits = 0
    async with (
        connect(settings.postgres_dsn) as pool,
        RedisCheckpointCache.for_settings(settings) as cache,
    ):
        truth = CheckpointReader(pool, None, tenant_id=tenant)
        for run in runs:
            doc, _ = await cache.get(tenant, run, "latest")
            expected = await truth.latest(run)
            assert expected is not None
            if doc is None:
                assert not require_all, f"{run}: not cached"
                continue
            hits += 1
            assert (doc["seq"], doc["state_hash"]) == (expected.seq, expected.state_hash), (
                run,
                doc["seq"],
                expected.seq,
            )
    return hits


async def assert_reads_fresh(settings: Settings, runs: list[str]) -> int:
    """What a reader gets for each run (its heads, through the cache) is PostgreSQL's
    latest, whatever the cache holds. Returns how many runs the cache served whole."""
    from alma_core.storage.cache import RedisCheckpointCache
    from alma_core.storage.observer import Tally
    from alma_core.storage.postgres import connect
    from alma_core.storage.reader import CheckpointReader

    assert settings.postgres_dsn
    assert settings.redis_url
    tally = Tally()
    async with (
        connect(settings.postgres_dsn) as pool,
        RedisCheckpointCache.for_settings(settings) as cache,
    ):
        reader = CheckpointReader(pool, cache, tenant_id=None, require_tenant=False, observer=tally)
        for run in runs:
            got = await reader.latest(run)
            truth = await pool.fetchrow(
                """SELECT seq, state_hash FROM checkpoints WHERE run_id = $1
                   ORDER BY seq DESC LIMIT 1""",
                run,
            )
            assert got is not None, run
            assert (got.seq, got.state_hash) == (truth["seq"], truth["state_hash"]), run
    return tally.counts["cache_hit"]


async def run_script(
    path: Path, env: dict[str, str], cwd: Path, timeout_s: float = 150
) -> tuple[int, str]:
    """A Python script (an example) run as a user runs it: its exit code and its output,
    stdout and stderr together."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(path),
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    return proc.returncode or 0, out.decode()
