"""Checkpointer benchmark: throughput, publish→durable+cached latency against a bare
Kafka hop, resume reads from the cache and from PostgreSQL, worker memory.

    python -m bench.checkpointer [--quick] [--out docs/benchmarks.md]

Runs on a fresh embedded stack (durable PostgreSQL: fsync on) in a temporary
directory, or on the services named by ALMA_KAFKA_BOOTSTRAP, ALMA_POSTGRES_DSN
and ALMA_REDIS_URL. Prints tables; with --out, writes them as markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from rich.progress import Progress

from alma_core import settings as settings_mod
from alma_core.cli.topics import ensure_topics
from alma_core.consumers.worker import Services, run_worker
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.observer import Tally
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from bench.env import CODEC, PARTITIONS, AlmaRun, checkpoint_worker, durable_floor, stack
from bench.report import console, ms, pct, report

PRODUCER_SETTINGS: dict[str, Any] = {"acks": "all", "linger_ms": 5, "compression_type": CODEC}
FETCH_MAX_WAIT_MS = 50


def state_of(size: int, i: int) -> dict[str, Any]:
    return {"i": i, "notes": "x" * max(0, size - 40), "ok": True}


def event(run: str, i: int, size: int, tenant: str = "bench") -> dict[str, Any]:
    return {
        "event_id": uuid.uuid4().hex,
        "type": "node.completed",
        "emitted_at": datetime.now(UTC).isoformat(),
        "tenant_id": tenant,
        "workflow_id": "wf",
        "run_id": run,
        "node_id": f"n{i}",
        "payload": {"state": state_of(size, i)},
    }


class Bench:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.rows: dict[str, list[list[str]]] = {}

    def add(self, table: str, row: Iterable[object]) -> None:
        self.rows.setdefault(table, []).append([str(c) for c in row])


def _produce_paced(
    bootstrap: str, topic: str, rate: float, seconds: float, size: int, tenant: str = "bench"
) -> None:
    """Load generator, in its own process so it does not share the worker's event loop
    or core. Each record carries its send time (CLOCK_MONOTONIC, shared by processes)."""

    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **PRODUCER_SETTINGS)
        await producer.start()
        start = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            doc = event(f"run-{i % 200}", i, size, tenant)
            await producer.send(
                topic,
                json.dumps(doc).encode(),
                key=doc["run_id"].encode(),
                headers=[("sent", repr(time.perf_counter()).encode())],
            )
        await producer.stop()

    asyncio.run(run())


def start_load(
    bootstrap: str, topic: str, rate: float, seconds: float, size: int, tenant: str = "bench"
) -> Any:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_produce_paced, args=(bootstrap, topic, rate, seconds, size, tenant))
    proc.start()
    return proc


def sent_at(record: Any) -> float:
    return float(dict(record.headers)["sent"])


async def bare_hop(
    bootstrap: str,
    rate: float,
    seconds: float,
    size: int,
    write: Callable[[list[bytes]], Awaitable[float]] | None = None,
) -> list[float]:
    """Publish → consumed per event through a plain consumer with the same settings;
    with ``write`` (:func:`bench.env.durable_floor`), each polled batch is also made
    durable, and what is returned is that write's time per event instead: the floor
    under ALMA's own time, at the same offered load on the same cores."""
    topic = f"bench-hop-{uuid.uuid4().hex[:8]}"
    await ensure_topics(bootstrap, [topic], partitions=PARTITIONS)
    got: list[float] = []
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"hop-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
    )
    await consumer.start()
    await asyncio.sleep(2.0)  # group assignment
    load = start_load(bootstrap, topic, rate, seconds, size)
    total = int(rate * seconds)
    deadline = time.monotonic() + seconds + 60
    while len(got) < total and time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=200)
        now = time.perf_counter()
        records = [r for rs in batch.values() for r in rs]
        if write is None:
            got.extend(now - sent_at(r) for r in records)
        elif records:
            took = await write([r.value for r in records])
            got.extend([took] * len(records))
    await consumer.stop()
    load.join()
    return got


async def alma_latency(
    s: settings_mod.Settings, services: Services, rate: float, seconds: float, size: int
) -> tuple[list[float], list[float], float]:
    """Publish → durable per event, the checkpointer's own part of it per event (its
    batch received by the handler → durable), and the worker's RSS."""
    topic = f"bench-life-{uuid.uuid4().hex[:8]}"
    await ensure_topics(services.kafka_bootstrap, [topic], partitions=PARTITIONS)
    s = s.model_copy(update={"lifecycle_topic": topic})
    done: list[float] = []
    own: list[float] = []

    def on_batch(events: int, received: float, durable: float) -> None:
        own.extend([durable - received] * events)

    async with checkpoint_worker(
        s, services, lambda r, now: done.append(now - sent_at(r)), on_batch
    ):
        load = start_load(services.kafka_bootstrap, topic, rate, seconds, size)
        total = int(rate * seconds)
        deadline = time.monotonic() + seconds + 120
        while len(done) < total and time.monotonic() < deadline:  # noqa: ASYNC110 - sampling
            await asyncio.sleep(0.05)
        rss = psutil.Process().memory_info().rss / 1e6
        await asyncio.to_thread(load.join)
    return done, own, rss


COUNT = "SELECT count(*) FROM checkpoints"


async def throughput(
    s: settings_mod.Settings,
    services: Services,
    n: int,
    size: int,
    state: dict[str, Any] | None = None,
) -> float:
    """Drain a backlog of ``n`` events (each with ``state`` and its step, when given;
    else ``size`` bytes of one string); checkpoints per second."""
    tag = uuid.uuid4().hex[:8]
    topic = f"bench-tp-{tag}"
    await ensure_topics(services.kafka_bootstrap, [topic], partitions=PARTITIONS)
    producer = AIOKafkaProducer(
        bootstrap_servers=services.kafka_bootstrap,
        acks="all",
        linger_ms=20,
        max_batch_size=1024 * 1024,
        compression_type=CODEC,
    )
    await producer.start()
    for i in range(n):
        doc = event(f"tp-{tag}-{i % 500}", i, size)  # runs of this call only
        if state is not None:
            doc["payload"]["state"] = {**state, "step": i}
        await producer.send(topic, json.dumps(doc).encode(), key=doc["run_id"].encode())
    await producer.flush()
    await producer.stop()
    s = s.model_copy(update={"lifecycle_topic": topic})
    async with connect(services.postgres_dsn) as pool:
        before = await pool.fetchval(COUNT)
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run_worker(s, services, ["checkpoint"], stop, ready=ready))
        try:
            await asyncio.wait_for(ready.wait(), 60)
            started = time.perf_counter()
            first = None
            while (now_count := await pool.fetchval(COUNT) - before) < n:
                if now_count > 0 and first is None:
                    first = time.perf_counter()
                if time.perf_counter() - started > 300:
                    raise RuntimeError(
                        f"{now_count:,} of {n:,} checkpoints after 300 s: the worker stalled "
                        "or skipped events; see its log above"
                    )
                await asyncio.sleep(0.05)
            elapsed = time.perf_counter() - (first or started)
        finally:
            stop.set()
            await task
    return n / elapsed


async def reads(
    services: Services, prefix: str, history: int, samples: int
) -> dict[str, list[float]]:
    run = f"read-{history}-{uuid.uuid4().hex[:6]}"
    async with (
        connect(services.postgres_dsn) as pool,
        RedisCheckpointCache.connect(services.redis_url, prefix=prefix) as cache,
    ):
        uncached = AlmaRun(pool, run)
        await uncached.extend(history, state_of(5000, 0))
        tally = Tally()
        reader = CheckpointReader(pool, cache, tenant_id="bench", observer=tally)
        await reader.branch_heads(run)  # fill the cache
        out: dict[str, list[float]] = {"cache": [], "postgres": []}
        for _ in range(samples):
            t = time.perf_counter()
            await reader.latest(run)
            out["cache"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await uncached.reader.latest(run)
            out["postgres"].append(time.perf_counter() - t)
        assert tally.counts["cache_hit"] >= samples
    return out


async def main(quick: bool, out: Path | None) -> None:
    bench = Bench(quick)
    seconds = 3.0 if quick else 8.0
    sizes = [1_000, 5_000] if quick else [1_000, 5_000, 100_000]
    loads = [200, 1000] if quick else [200, 1000, 2000]
    backlog = 3_000 if quick else 20_000
    with Progress(console=console) as progress:
        async with stack(quick, 1, False, progress) as env:
            s, services, task = env.s, env.services, env.task
            progress.update(
                task, description="benchmarks", total=len(sizes) * (len(loads) * 2 + 1) + 2
            )
            for size in sizes:
                rate_list = loads if size < 50_000 else [200]
                for rate in rate_list:
                    hop = await bare_hop(services.kafka_bootstrap, rate, seconds, size)
                    async with durable_floor(env.peer_dsn) as write:
                        floor = await bare_hop(services.kafka_bootstrap, rate, seconds, size, write)
                    progress.advance(task)
                    lat, own, rss = await alma_latency(s, services, rate, seconds, size)
                    progress.advance(task)
                    bench.add(
                        "latency",
                        [
                            f"{size // 1000} KB",
                            rate,
                            len(lat),
                            ms(hop, 50),
                            ms(hop, 99),
                            ms(lat, 50),
                            ms(lat, 95),
                            ms(lat, 99),
                            f"{(pct(lat, 99) - pct(hop, 99)) * 1000:.1f}",
                            ms(floor, 50),
                            ms(floor, 99),
                            ms(own, 50),
                            ms(own, 99),
                            f"{rss:.0f}",
                        ],
                    )
                n = backlog if size < 50_000 else backlog // 10
                rate_done = await throughput(s, services, n, size)
                bench.add("throughput", [f"{size // 1000} KB", n, f"{rate_done:,.0f}"])
                progress.advance(task)
            for history in (10, 1000):
                r = await reads(services, s.redis_prefix, history, 300 if quick else 1000)
                bench.add(
                    "reads",
                    [
                        history,
                        ms(r["cache"], 50),
                        ms(r["cache"], 99),
                        ms(r["postgres"], 50),
                        ms(r["postgres"], 99),
                    ],
                )
                progress.advance(task)
    report("checkpointer", bench.rows, HEADERS, TITLES, out)


HEADERS = {
    "throughput": ["state", "events", "checkpoints/s"],
    "latency": [
        "state",
        "offered ev/s",
        "events",
        "bare hop p50 ms",
        "bare hop p99 ms",
        "ALMA p50 ms",
        "ALMA p95 ms",
        "ALMA p99 ms",
        "added p99 ms",
        "durable floor p50 ms",
        "durable floor p99 ms",
        "ALMA's own p50 ms",
        "ALMA's own p99 ms",
        "worker RSS MB",
    ],
    "reads": [
        "checkpoints in run",
        "cache p50 ms",
        "cache p99 ms",
        "PostgreSQL p50 ms",
        "PostgreSQL p99 ms",
    ],
}
TITLES = {
    "throughput": "Sustained throughput (drain a backlog, one worker)",
    "latency": "Publish → durable, cached and handed on (fixed offered load)",
    "reads": "Latest-checkpoint read (resume path)",
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    asyncio.run(main(args.quick, args.out))
