"""How cost grows with work: throughput and p99 against offered load until
saturation (ALMA end to end and LangGraph's ``aput``), write and read cost
against run length and table size (both systems), and retrieval against memory
count per scope. Merge cost curves are in ``bench.merges``."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg
import numpy as np
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg_pool import AsyncConnectionPool

from alma_core.storage.postgres import connect
from bench import learner
from bench.checkpointer import sent_at, start_load, state_of
from bench.env import AlmaRun, Env, checkpoint_worker
from bench.peers import (
    analyze,
    langgraph_saver_pool,
    lg_config,
    lg_put,
    realistic_state,
    time_calls,
)
from bench.report import Section, Stat, console, pct

SATURATED_P99_S = 2.0


def loads(env: Env) -> tuple[int, ...]:
    return (100, 400, 1600, 3200) if env.quick else (100, 250, 500, 1000, 2000, 4000, 8000)


def lengths(env: Env) -> tuple[int, ...]:
    return (10, 100, 1_000) if env.quick else (10, 100, 1_000, 10_000)


def table_sizes(env: Env) -> tuple[int, ...]:
    if env.quick:
        return (10_000, 100_000)
    return (10_000, 100_000, 1_000_000, 10_000_000) if env.full else (10_000, 100_000, 1_000_000)


def memory_counts(env: Env) -> tuple[int, ...]:
    if env.quick:
        return (10_000, 50_000)
    return (10_000, 100_000, 1_000_000) if env.full else (10_000, 100_000)


def steps(env: Env) -> int:
    return 2 * len(loads(env)) + len(lengths(env)) + len(table_sizes(env)) + len(memory_counts(env))


# --- offered load ---------------------------------------------------------------------


async def alma_at(env: Env, rate: int, seconds: float) -> dict[str, float]:
    """Open loop: a separate process offers ``rate`` events/s (1 KB states, 200 runs)."""
    topic = await env.topic("load")
    s = env.settings_for(topic)
    done: list[tuple[float, float]] = []
    total = int(rate * seconds)
    async with checkpoint_worker(s, env.services, lambda r, now: done.append((sent_at(r), now))):
        proc = start_load(env.services.kafka_bootstrap, topic, rate, seconds, 1_000)
        deadline = time.monotonic() + seconds + 30
        while len(done) < total and time.monotonic() < deadline:  # noqa: ASYNC110 - sampling
            await asyncio.sleep(0.05)
        await asyncio.to_thread(proc.join, 30)
    return load_point(rate, total, done)


async def langgraph_at(
    pool: AsyncConnectionPool[Any], rate: int, seconds: float
) -> dict[str, float]:
    """Open loop on ``aput``: calls start on schedule over 50 savers (threads)."""
    savers = [AsyncPostgresSaver(pool) for _ in range(50)]  # type: ignore[arg-type]
    tag = uuid.uuid4().hex[:6]
    done: list[tuple[float, float]] = []
    total = int(rate * seconds)

    async def one(i: int, due: float) -> None:
        await lg_put(savers[i % 50], lg_config(f"{tag}-{i % 200}"), state_of(1_000, i), i)
        done.append((due, time.perf_counter()))

    tasks = []
    start = time.perf_counter()
    for i in range(total):
        due = start + i / rate
        if (delay := due - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.wait(tasks, timeout=seconds + 30)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return load_point(rate, total, done)


def load_point(rate: int, total: int, done: list[tuple[float, float]]) -> dict[str, float]:
    if not done:
        return {
            "offered": rate,
            "achieved": 0.0,
            "p50": float("nan"),
            "p99": float("nan"),
            "completed": 0.0,
        }
    latencies = [end - sent for sent, end in done]
    span = max(end for _, end in done) - min(sent for sent, _ in done)
    return {
        "offered": rate,
        "achieved": len(done) / span,
        "p50": pct(latencies, 50) * 1000,
        "p99": pct(latencies, 99) * 1000,
        "completed": len(done) / total,
    }


def saturated(point: dict[str, float]) -> bool:
    return point["achieved"] < 0.8 * point["offered"] or point["p99"] > SATURATED_P99_S * 1000


async def offered_load(env: Env, section: Section, pool: AsyncConnectionPool[Any]) -> None:
    section.table(
        "load",
        "Throughput and latency against offered load (1 KB states, open loop)",
        ["system", "offered ev/s", "achieved ev/s", "p50 ms", "p99 ms", "completed"],
    )
    seconds = 3.0 if env.quick else 5.0
    for system in ("ALMA", "LangGraph"):
        for rate in loads(env):
            env.step(f"offered load: {system} at {rate}/s")
            runs = []
            for _ in range(env.reps):
                runs.append(
                    await alma_at(env, rate, seconds)
                    if system == "ALMA"
                    else await langgraph_at(pool, rate, seconds)
                )
            keys = (("achieved", 0), ("p50", 1), ("p99", 1), ("completed", 2))
            section.add("load", [system, rate, *(Stat([r[k] for r in runs], d) for k, d in keys)])
            env.done()
            if all(saturated(r) for r in runs):
                env.done(len(loads(env)) - loads(env).index(rate) - 1)
                break
    section.note(
        "load",
        f"Each system stops at the first load it cannot carry (achieved < 80 % "
        f"of offered, or p99 > {SATURATED_P99_S:.0f} s in every repetition).",
    )


# --- run length and table size --------------------------------------------------------


class LangGraphThread:
    def __init__(self, pool: AsyncConnectionPool[Any], thread: str) -> None:
        self.saver = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
        self.config, self.thread, self.step = lg_config(thread), thread, 0

    async def extend(self, count: int, state: dict[str, Any]) -> None:
        for _ in range(count):
            self.config = await lg_put(
                self.saver, self.config, {**state, "step": self.step}, self.step
            )
            self.step += 1

    async def latest(self) -> None:
        await self.saver.aget_tuple(lg_config(self.thread))


async def costs(env: Env, alma: AlmaRun, lg: LangGraphThread, state: dict[str, Any]) -> list[Stat]:
    """Write and read p50 of both systems, over repetitions."""
    writes, reads = (10, 50) if env.quick else (30, 150)
    out: dict[str, list[float]] = {"aw": [], "ar": [], "lw": [], "lr": []}
    for _ in range(env.reps):
        out["aw"].append(pct(await time_calls(lambda: alma.extend(1, state), writes), 50))
        out["ar"].append(pct(await time_calls(alma.latest, reads), 50))
        out["lw"].append(pct(await time_calls(lambda: lg.extend(1, state), writes), 50))
        out["lr"].append(pct(await time_calls(lg.latest, reads), 50))
    return [Stat([v * 1000 for v in out[k]]) for k in ("aw", "lw", "ar", "lr")]


COST_HEADERS = [
    "ALMA write p50 ms",
    "LangGraph aput p50 ms",
    "ALMA latest p50 ms",
    "LangGraph aget_tuple p50 ms",
]


async def run_length(env: Env, section: Section, pool: AsyncConnectionPool[Any]) -> None:
    section.table(
        "run_length",
        "Write and read cost against run length (1 KB states, "
        "PostgreSQL only: no broker, no cache)",
        ["checkpoints in run", *COST_HEADERS],
    )
    state = realistic_state(1_000, seed=1)
    tag = uuid.uuid4().hex[:6]
    async with connect(env.services.postgres_dsn) as pg:
        alma, lg = AlmaRun(pg, f"len-{tag}"), LangGraphThread(pool, f"len-{tag}")
        for length in lengths(env):
            env.step(f"run length {length:,}")
            await alma.extend(length - alma.offset, state)
            await lg.extend(length - lg.step, state)
            await analyze(env)
            section.add("run_length", [f"{length:,}", *await costs(env, alma, lg, state)])
            env.done()


ALMA_FILL = [
    "INSERT INTO runs (run_id, tenant_id, workflow_id, last_seq, event_count) "
    "SELECT 'fill-' || r, 'fill', 'wf', 1000, 1000 FROM generate_series($1::bigint / 1000, "
    "($2::bigint - 1) / 1000) r ON CONFLICT DO NOTHING",
    "INSERT INTO run_events (event_id, run_id, tenant_id, type, node_id, emitted_at, "
    "checkpoint_seq, effect) SELECT md5(g::text), 'fill-' || (g / 1000), 'fill', "
    "'node.completed', 'n', now(), g % 1000 + 1, 'checkpoint' FROM generate_series($1, $2 - 1) g",
    "INSERT INTO checkpoints (run_id, seq, tenant_id, kind, node_id, event_id, state, "
    "state_hash, size_bytes) SELECT 'fill-' || (g / 1000), g % 1000 + 1, 'fill', 'node', 'n', "
    "md5(g::text), jsonb_build_object('step', g, 'notes', repeat(md5(g::text), 8)), "
    "md5(g::text), 300 FROM generate_series($1, $2 - 1) g",
]
LG_FILL = (
    "INSERT INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, type, checkpoint, "
    "metadata) SELECT 'fill-' || (g / 1000), '', '1f0' || lpad(g::text, 33, '0'), 'msgpack', "
    "jsonb_build_object('v', 4, 'id', '1f0' || lpad(g::text, 33, '0'), 'ts', now()::text, "
    "'channel_values', jsonb_build_object('step', g, 'notes', repeat(md5(g::text), 8)), "
    "'channel_versions', '{}'::jsonb, 'versions_seen', '{}'::jsonb), "
    "jsonb_build_object('source', 'loop', 'step', g % 1000) FROM generate_series($1, $2 - 1) g"
)


async def fill(dsn: str, statements: list[str], start: int, stop: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for lo in range(start, stop, 500_000):
            hi = min(stop, lo + 500_000)
            async with conn.transaction():
                for sql in statements:
                    await conn.execute(sql, lo, hi)
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def table_size(env: Env, section: Section, pool: AsyncConnectionPool[Any]) -> None:
    section.table(
        "table_size",
        "Write and read cost against table size (1 KB states, a run "
        "of 10 checkpoints among filler rows; PostgreSQL only)",
        ["checkpoints in table", *COST_HEADERS],
    )
    state = realistic_state(1_000, seed=2)
    filled = 0
    async with connect(env.services.postgres_dsn) as pg:
        for size in table_sizes(env):
            env.step(f"table of {size:,} checkpoints: filling")
            started = time.perf_counter()
            await fill(env.services.postgres_dsn, ALMA_FILL, filled, size)
            await fill(env.peer_dsn, [LG_FILL], filled, size)
            console.print(
                f"filled both tables to {size:,} checkpoints in "
                f"{time.perf_counter() - started:.0f} s"
            )
            filled = size
            env.step(f"table of {size:,} checkpoints: measuring")
            tag = uuid.uuid4().hex[:6]
            alma, lg = AlmaRun(pg, f"size-{tag}"), LangGraphThread(pool, f"size-{tag}")
            await alma.extend(10, state)
            await lg.extend(10, state)
            section.add("table_size", [f"{size:,}", *await costs(env, alma, lg, state)])
            env.done()
    section.note(
        "table_size",
        "Filler rows are inserted in bulk (ALMA: runs, run_events and "
        "checkpoints; LangGraph: checkpoints with inline values), then ANALYZE.",
    )


# --- retrieval ------------------------------------------------------------------------


async def retrieval(env: Env, section: Section) -> None:
    section.table(
        "retrieval",
        "Scoped retrieval against memory count (database side, top_k=10)",
        learner.HEADERS["retrieval"],
    )
    centres = learner.centres(np.random.default_rng(7))
    for total in memory_counts(env):
        env.step(f"retrieval over {total:,} memories")
        await learner.load(env.services.postgres_dsn, total, centres, 11, env.progress)
        rows = await learner.retrieval(
            env.services.postgres_dsn, total, centres, 30 if env.quick else 60, 11
        )
        for row in rows:
            section.add("retrieval", list(row))
        env.done()
    section.note(
        "retrieval",
        "One repetition per point (each row is 30–60 queries); "
        "python -m bench.learner adds the outcome-saving table.",
    )


async def run(env: Env, section: Section) -> None:
    pool = await langgraph_saver_pool(env.peer_dsn, size=20)
    try:
        await offered_load(env, section, pool)
        await run_length(env, section, pool)
        await table_size(env, section, pool)
    finally:
        await pool.close()
    await retrieval(env, section)
