"""The scaling trend: 1, 2 and 4 ``alma worker --consumers checkpoint`` processes in
one consumer group on a 12-partition topic, each given the same backlog. The
group is settled (all 12 partitions assigned, read from the workers' /metrics)
before the backlog is published; the rate is read from the end of publishing
(or 10 % drained, if later) to 90 % drained, so neither start-up, rebalancing
nor the producer is in it."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg
from aiokafka import AIOKafkaProducer

from bench.checkpointer import event
from bench.env import CODEC, Env, checkpoint_processes, scratch
from bench.report import Section, Stat, ratio

PROCESSES = (1, 2, 4)
RUNS = 200


async def drained(pool: asyncpg.Pool, runs: list[str]) -> int:
    return int(
        await pool.fetchval(
            "SELECT coalesce(sum(event_count), 0) FROM runs WHERE run_id = ANY($1::text[])", runs
        )
    )


async def one(env: Env, processes: int, backlog: int, logs: Path) -> float:
    topic = await env.topic("scale")
    tag = uuid.uuid4().hex[:6]
    s = env.settings_for(topic, group_prefix=f"scale-{tag}")
    runs = [f"{tag}-{r}" for r in range(RUNS)]
    async with checkpoint_processes([s] * processes, logs):
        published = await publish_backlog(env, topic, runs, backlog)
        return await drain_rate(env, runs, backlog, published, logs)


async def publish_backlog(
    env: Env,
    topic: str,
    runs: list[str],
    backlog: int,
    headers: Callable[[], list[tuple[str, bytes]] | None] = lambda: None,
) -> float:
    """``backlog`` node.completed events of 1 KB states over ``runs``, each with the
    ``headers`` given; when publishing ended (``time.perf_counter()``)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=env.services.kafka_bootstrap,
        acks="all",
        linger_ms=20,
        max_batch_size=1 << 20,
        compression_type=CODEC,
    )
    await producer.start()
    for i in range(backlog):
        doc = event(runs[i % len(runs)], i, 1_000)
        await producer.send(
            topic, json.dumps(doc).encode(), key=doc["run_id"].encode(), headers=headers()
        )
    await producer.flush()
    await producer.stop()
    return time.perf_counter()


async def drain_rate(
    env: Env, runs: list[str], backlog: int, published: float, logs: Path
) -> float:
    """Checkpoints per second from publishing done (or 10 % drained, if later) to 90 %
    drained."""
    async with asyncpg.create_pool(env.services.postgres_dsn, min_size=1, max_size=1) as pool:
        marks: list[tuple[float, int]] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            marks.append((time.perf_counter(), await drained(pool, runs)))
            if marks[-1][1] >= 0.9 * backlog:
                break
            await asyncio.sleep(0.1)
    t0, n0 = next(((t, n) for t, n in marks if t >= published and n >= 0.1 * backlog), marks[0])
    t1, n1 = marks[-1]
    if n1 <= n0 or t1 <= t0:
        raise RuntimeError(f"the backlog was not drained in a measurable window; see {logs}")
    return (n1 - n0) / (t1 - t0)


async def run(env: Env, section: Section) -> None:
    section.table(
        "scaling",
        "Checkpointer processes in one group (12 partitions, 1 KB states, "
        f"{RUNS} runs, backlog drained)",
        ["processes", "checkpoints/s", "× one process"],
    )
    backlog = 20_000 if env.quick else 60_000
    rates: dict[int, Stat] = {}
    with scratch("alma-bench-scaling-") as logs:
        for processes in PROCESSES:
            env.step(f"scaling: {processes} checkpointer process(es)")
            rates[processes] = Stat(
                [await one(env, processes, backlog, logs) for _ in range(env.reps)], 0
            )
            section.add("scaling", [processes, rates[processes], ratio(rates[processes], rates[1])])
            env.done()
    section.note(
        "scaling",
        f"{os.cpu_count()} cores shared by the workers, PostgreSQL, Redis, "
        "the broker and the benchmark.",
    )
