"""ALMA Stream side by side with what users would otherwise write, in one run on one
PostgreSQL server: LangGraph's ``AsyncPostgresSaver`` for checkpoints and latest
reads, LangGraph's reducer application for a 5-branch merge, and the workflow
state seed's JSONB column (``UPDATE ... SET state = state || $1``) for run state.

Each figure is measured ``env.reps`` times, ALMA and the peer back to back in each
repetition, so the ratios pair runs that shared the machine's noise."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.storage.postgres import connect
from alma_core.types import WorkflowContext
from bench.checkpointer import throughput
from bench.cpu import GROUPS, CpuMeter, service_ports
from bench.env import (
    CODEC,
    PARTITIONS,
    AlmaRun,
    Env,
    Waiters,
    checkpoint_processes,
    checkpoint_worker,
    durable_floor,
    node_completed,
)
from bench.report import Section, Stat, pct, ratio

# On a fresh, short topic the embedded broker stays fast with a short fetch wait;
# it does not wake a waiting fetch when data arrives (Apache Kafka does), so each
# hop costs about half of it on sparse traffic: the "Kafka hop alone" rows show it.
FETCH_WAIT_MS = 20
# ALMA with the checkpointer in a process of its own, writers waiting with applied()
OWN_PROCESS = "ALMA, checkpointer in its own process"
WORDS = (
    "plan",
    "search",
    "the",
    "customer",
    "invoice",
    "tool",
    "call",
    "returned",
    "result",
    "summary",
    "of",
    "a",
    "step",
    "agent",
    "retry",
    "cost",
    "token",
    "answer",
    "draft",
    "review",
    "policy",
    "refund",
    "order",
    "shipping",
    "status",
    "error",
)


def realistic_state(size: int, seed: int = 0) -> dict[str, Any]:
    """An agent's state of about ``size`` bytes of JSON: a message list of varied
    text (not a run of one character, which TOAST would compress to nothing),
    facts, a summary and a step counter."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = []
    facts: dict[str, str] = {}
    used = 120
    while used < size:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        messages.append(
            {
                "role": rng.choice(("user", "assistant", "tool")),
                "content": text,
                "tokens": rng.randint(10, 900),
            }
        )
        facts[f"fact-{len(facts)}"] = uuid.UUID(int=rng.getrandbits(128)).hex
        used += len(text) + 110
    return {"messages": messages, "facts": facts, "summary": "working on it", "step": 0}


def figures(latencies: list[float], elapsed: float) -> dict[str, float]:
    return {
        "per_s": len(latencies) / elapsed,
        "p50": pct(latencies, 50) * 1000,
        "p95": pct(latencies, 95) * 1000,
        "p99": pct(latencies, 99) * 1000,
    }


# --- checkpoint writes --------------------------------------------------------------


async def alma_writes(
    env: Env,
    state: dict[str, Any],
    writers: int,
    each: int,
    *,
    process: bool = False,
    meter: CpuMeter | None = None,
    codec: str | None = CODEC,
) -> tuple[list[float], float]:
    """Closed loop, ``writers`` runs at once: publish one node.completed with the whole
    state, wait until it is durable and cached, publish the next. ``process``: as
    deployed, the checkpointer runs in a process of its own (``alma worker``) and each
    writer is the SDK's user: it publishes with ``node_completed`` and waits with
    ``applied()`` (durable; woken by the commit's notice). ``codec``: the records'
    compression (ALMA_KAFKA_COMPRESSION's, unless a row compares it with none)."""
    topic = await env.topic("w")
    s = env.settings_for(topic, fetch_max_wait_ms=FETCH_WAIT_MS)
    waiters = Waiters()
    latencies: list[float] = []
    producer = AIOKafkaProducer(
        bootstrap_servers=env.services.kafka_bootstrap,
        acks="all",
        linger_ms=0,
        max_request_size=4 * 2**20,
        compression_type=codec,
    )
    await producer.start()
    tag = uuid.uuid4().hex[:8]
    client = AlmaClient(s) if process else None
    if client is not None:
        await client.start()

    async def writer(w: int, n: int, record: bool) -> None:
        run = f"{tag}-{w}"
        for i in range(n):
            step = {**state, "step": i}
            if client is not None:
                ctx = WorkflowContext(
                    tenant_id="bench", workflow_id="wf", run_id=run, node_id=f"n{i}"
                )
                started = time.perf_counter()
                event_id = await client.node_completed(ctx, state=step)
                await client.applied(ctx, event_id, timeout=60)
            else:
                event_id, raw = node_completed(run, i, step)
                fut = waiters.expect(event_id)
                started = time.perf_counter()
                await producer.send_and_wait(
                    topic, raw, key=run.encode(), headers=[("eid", event_id.encode())]
                )
                await asyncio.wait_for(fut, 60)
            if record:
                latencies.append(time.perf_counter() - started)

    worker = (
        checkpoint_processes([s])
        if process
        else checkpoint_worker(s, env.services, waiters.on_done)
    )
    try:
        async with worker:
            await writer(-1, 5, record=False)  # warm: assignment, connections, cache
            elapsed = await _timed(meter, *(writer(w, each, True) for w in range(writers)))
    finally:
        await producer.stop()
        if client is not None:
            await client.stop()
    return latencies, elapsed


async def bare_hop(
    env: Env,
    state: dict[str, Any],
    writers: int,
    each: int,
    meter: CpuMeter | None = None,
    *,
    durable: bool = False,
    codec: str | None = CODEC,
) -> tuple[list[float], float]:
    """The same closed loop through a plain consumer with the same fetch wait: what the
    broker alone gives, and so the most ALMA's loop could carry on it. ``durable``: the
    consumer also makes each polled batch durable before the writers go on, in the least
    way there is (:func:`bench.env.durable_floor`): the most any consumer that writes
    to PostgreSQL could carry here."""
    if not durable:
        return await _hop(env, state, writers, each, meter, None, codec)
    async with durable_floor(env.peer_dsn) as write:
        return await _hop(env, state, writers, each, meter, write, codec)


async def _hop(
    env: Env,
    state: dict[str, Any],
    writers: int,
    each: int,
    meter: CpuMeter | None,
    write: Callable[[list[bytes]], Awaitable[float]] | None,
    codec: str | None,
) -> tuple[list[float], float]:
    topic = await env.topic("hop")
    waiters = Waiters()
    # every partition assigned by hand, no group: the same fetches as a group member's,
    # without a join and a leave (seconds each on this broker) around every loop
    consumer = AIOKafkaConsumer(
        bootstrap_servers=env.services.kafka_bootstrap,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=FETCH_WAIT_MS,
        max_partition_fetch_bytes=4 * 2**20,
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=env.services.kafka_bootstrap,
        acks="all",
        linger_ms=0,
        max_request_size=4 * 2**20,
        compression_type=codec,
    )
    await consumer.start()
    consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
    await producer.start()

    async def consume() -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            if batch and write is not None:
                await write([r.value for records in batch.values() for r in records])
            now = time.perf_counter()
            for records in batch.values():
                for r in records:
                    waiters.on_done(r, now)

    latencies: list[float] = []
    tag = uuid.uuid4().hex[:8]

    async def writer(w: int, n: int, record: bool) -> None:
        run = f"hop-{tag}-{w}"
        for i in range(n):
            event_id, raw = node_completed(run, i, {**state, "step": i})
            fut = waiters.expect(event_id)
            started = time.perf_counter()
            await producer.send_and_wait(
                topic, raw, key=run.encode(), headers=[("eid", event_id.encode())]
            )
            await asyncio.wait_for(fut, 30)
            if record:
                latencies.append(time.perf_counter() - started)

    reader = asyncio.create_task(consume())
    try:
        await writer(-1, 3, record=False)  # warm: connections, the first fetches
        elapsed = await _timed(meter, *(writer(w, each, True) for w in range(writers)))
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await producer.stop()
        await consumer.stop()
    return latencies, elapsed


async def _timed(meter: CpuMeter | None, *writers: Awaitable[None]) -> float:
    """Run the writers at once; their wall time (and CPU, on ``meter``)."""
    if meter is not None:
        meter.start()
    started = time.perf_counter()
    await asyncio.gather(*writers)
    elapsed = time.perf_counter() - started
    if meter is not None:
        meter.stop()
    return elapsed


def lg_config(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}


async def lg_put(
    saver: AsyncPostgresSaver, config: dict[str, Any], state: dict[str, Any], step: int
) -> dict[str, Any]:
    """One LangGraph checkpoint holding ``state``, every channel changed (as ALMA's
    node.completed carries the whole state)."""
    cp = empty_checkpoint()
    prev = config["configurable"].get("versions", {})
    versions = {k: saver.get_next_version(prev.get(k), None) for k in state}
    cp["channel_values"] = dict(state)
    cp["channel_versions"] = versions
    meta: Any = {"source": "loop", "step": step, "parents": {}}
    out: dict[str, Any] = await saver.aput(config, cp, meta, versions)  # type: ignore[arg-type]
    out["configurable"]["versions"] = versions
    return out


async def langgraph_writes(
    pool: AsyncConnectionPool[Any],
    state: dict[str, Any],
    writers: int,
    each: int,
    meter: CpuMeter | None = None,
) -> tuple[list[float], float]:
    """The same closed loop on ``aput``: a saver per writer (one saver serialises its
    calls behind a lock), one pool of connections shared."""
    tag = uuid.uuid4().hex[:8]
    latencies: list[float] = []

    async def writer(w: int, n: int, record: bool) -> None:
        saver = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
        config = lg_config(f"{tag}-{w}")
        for i in range(n):
            started = time.perf_counter()
            config = await lg_put(saver, config, {**state, "step": i}, i)
            if record:
                latencies.append(time.perf_counter() - started)

    await writer(-1, 5, record=False)
    return latencies, await _timed(meter, *(writer(w, each, True) for w in range(writers)))


ALMA_TABLES = ("checkpoints", "run_events", "run_heads", "runs")
LG_TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")


async def table_bytes(dsn: str, tables: tuple[str, ...]) -> tuple[int, int, int]:
    """Bytes of the first table, of all of them (indexes and TOAST included), and the
    first table's rows."""
    conn = await asyncpg.connect(dsn)
    try:
        sizes = [
            await conn.fetchval("SELECT pg_total_relation_size($1::regclass)", t) for t in tables
        ]
        rows = await conn.fetchval(f"SELECT count(*) FROM {tables[0]}")
    finally:
        await conn.close()
    return sizes[0], sum(sizes), rows


HOP = "Kafka hop alone (same settings)"
DURABLE_HOP = "Kafka hop + one INSERT per batch (same settings)"
# the 50 writers' loops again with records uncompressed, beside the codec's
ALMA_RAW = "ALMA, records uncompressed"
DURABLE_RAW = "durable hop, records uncompressed"


def _system_name(system: str) -> str:
    return {
        "hop": HOP,
        "durable hop": DURABLE_HOP,
        DURABLE_RAW: "Kafka hop + one INSERT per batch, records uncompressed",
    }.get(system, system)


async def writes(env: Env, section: Section, pool: AsyncConnectionPool[Any]) -> None:
    section.table(
        "writes",
        "Checkpoint writes: publish → durable and cached (ALMA) vs "
        "`AsyncPostgresSaver.aput` (LangGraph)",
        ["state", "writers", "system", "checkpoints/s", "p50 ms", "p95 ms", "p99 ms"],
    )
    section.table(
        "write_ratio",
        "Checkpoint writes, ALMA ÷ LangGraph (paired repetitions)",
        ["state", "writers", "throughput ×", "p50 ×", "p99 ×"],
    )
    section.table(
        "ceiling",
        "What this broker and PostgreSQL allow on these cores: the least durable consumer "
        "(hop + one INSERT per batch) ÷ LangGraph, and ALMA ÷ it (checkpoints/s, paired)",
        [
            "state",
            "writers",
            "durable hop ÷ LangGraph",
            "ALMA ÷ durable hop",
            "ALMA, own process ÷ durable hop",
        ],
    )
    section.table(
        "cpu",
        "Where a checkpoint's CPU goes, 50 writers: ms of CPU per checkpoint by process, "
        "and the machine's busy share (both cores) over the loop",
        ["state", "system", *(f"{g} ms" for g in GROUPS), "total ms", "machine busy %"],
    )
    section.table(
        "codec",
        f"Records compressed with {CODEC or 'nothing'} ÷ uncompressed, 50 writers "
        "(paired): checkpoints/s, and CPU per checkpoint in every process",
        ["state", "writers", "system", "checkpoints/s ×", "CPU per checkpoint ×"],
    )
    if not CODEC:
        section.note("codec", "ALMA_KAFKA_COMPRESSION=none: no codec to compare.")
    section.table(
        "storage",
        "Storage per checkpoint (bytes, indexes and TOAST included)",
        [
            "state",
            "ALMA checkpoints table",
            "ALMA with audit trail and heads",
            "LangGraph checkpoints table",
            "LangGraph with blobs and writes",
        ],
    )
    unseen: set[str] = set()  # services not on this machine: their CPU is not measured
    for size in (5_000, 100_000):
        state = realistic_state(size, seed=size)
        before_a = await table_bytes(env.services.postgres_dsn, ALMA_TABLES)
        before_l = await table_bytes(env.peer_dsn, LG_TABLES)
        for writers in (1, 50):
            big = size > 50_000
            if writers == 1:
                each = env.fewer((20 if big else 40) if env.quick else (50 if big else 150))
            else:
                each = env.fewer((2 if big else 4) if env.quick else (8 if big else 20))
            got: dict[str, list[dict[str, float]]] = {
                "ALMA": [],
                "LangGraph": [],
                "hop": [],
                "durable hop": [],
            }
            if writers > 1:
                got[OWN_PROCESS] = []
            compare = writers > 1 and CODEC is not None
            if compare:
                got[ALMA_RAW], got[DURABLE_RAW] = [], []
            cpu: dict[str, list[dict[str, float]]] = {k: [] for k in got}
            for rep in range(env.reps):
                env.step(f"writes {size // 1000} KB × {writers} writers")
                meter = CpuMeter(service_ports(env.services)) if writers > 1 else None
                loops: list[tuple[str, Callable[[], Awaitable[tuple[list[float], float]]]]] = [
                    ("ALMA", partial(alma_writes, env, state, writers, each, meter=meter)),
                    ("LangGraph", partial(langgraph_writes, pool, state, writers, each, meter)),
                    ("hop", partial(bare_hop, env, state, writers, each, meter)),
                    (
                        "durable hop",
                        partial(bare_hop, env, state, writers, each, meter, durable=True),
                    ),
                ]
                if writers > 1:
                    own = partial(alma_writes, env, state, writers, each, process=True, meter=meter)
                    loops.insert(1, (OWN_PROCESS, own))
                if compare:
                    raw = partial(alma_writes, env, state, writers, each, meter=meter, codec=None)
                    floor = partial(
                        bare_hop, env, state, writers, each, meter, durable=True, codec=None
                    )
                    loops += [(ALMA_RAW, raw), (DURABLE_RAW, floor)]
                # every other repetition in reverse: no system always first or last
                # (the machine drifts within a repetition; the ratios are paired)
                for system, loop in loops if rep % 2 == 0 else loops[::-1]:
                    latencies, elapsed = await loop()
                    got[system].append(figures(latencies, elapsed))
                    if meter is not None and meter.last is not None:
                        share = meter.last
                        cpu[system].append({**share.per(len(latencies)), "busy": share.busy})
                        unseen.update(share.unseen)
                env.done()
            label = f"{size // 1000} KB"
            for system, runs in got.items():
                if not runs:
                    continue
                section.add(
                    "writes",
                    [
                        label,
                        writers,
                        _system_name(system),
                        *(
                            Stat([r[k] for r in runs], 0 if k == "per_s" else 1)
                            for k in ("per_s", "p50", "p95", "p99")
                        ),
                    ],
                )
            lg = {k: Stat([r[k] for r in got["LangGraph"]]) for k in ("per_s", "p50", "p99")}
            for system in ("ALMA", OWN_PROCESS):
                if system not in got:
                    continue
                a = {k: Stat([r[k] for r in got[system]]) for k in ("per_s", "p50", "p99")}
                ratios = [ratio(a[k], lg[k]) for k in ("per_s", "p50", "p99")]
                shape = "" if system == "ALMA" else " (checkpointer in its own process)"
                section.add("write_ratio", [label, f"{writers}{shape}", *ratios])
            durable = Stat([r["per_s"] for r in got["durable hop"]])
            ceiling = [ratio(durable, lg["per_s"])]
            for system in ("ALMA", OWN_PROCESS):
                if system in got:
                    ceiling.append(ratio(Stat([r["per_s"] for r in got[system]]), durable))
            section.add("ceiling", [label, writers, *ceiling, *(["—"] * (3 - len(ceiling)))])
            if compare:
                for system, raw_system in (("ALMA", ALMA_RAW), ("durable hop", DURABLE_RAW)):
                    cpu_x: Stat | str = "—"
                    if cpu[system] and cpu[raw_system]:
                        cpu_x = ratio(
                            Stat([c["total"] for c in cpu[system]]),
                            Stat([c["total"] for c in cpu[raw_system]]),
                        )
                    section.add(
                        "codec",
                        [
                            label,
                            writers,
                            _system_name(system),
                            ratio(
                                Stat([r["per_s"] for r in got[system]]),
                                Stat([r["per_s"] for r in got[raw_system]]),
                            ),
                            cpu_x,
                        ],
                    )
            for system, shares in cpu.items():
                if shares:
                    section.add(
                        "cpu",
                        [
                            label,
                            _system_name(system),
                            *(Stat([c[k] for c in shares], 2) for k in (*GROUPS, "total")),
                            Stat([c["busy"] * 100 for c in shares], 0),
                        ],
                    )
        after_a = await table_bytes(env.services.postgres_dsn, ALMA_TABLES)
        after_l = await table_bytes(env.peer_dsn, LG_TABLES)
        n_a, n_l = after_a[2] - before_a[2], after_l[2] - before_l[2]
        section.add(
            "storage",
            [
                f"{size // 1000} KB",
                f"{(after_a[0] - before_a[0]) / n_a:,.0f}",
                f"{(after_a[1] - before_a[1]) / n_a:,.0f}",
                f"{(after_l[0] - before_l[0]) / n_l:,.0f}",
                f"{(after_l[1] - before_l[1]) / n_l:,.0f}",
            ],
        )
    if unseen:
        section.note("cpu", f"Not measured (not on this machine): {', '.join(sorted(unseen))}.")


# --- latest-checkpoint reads --------------------------------------------------------


async def analyze(env: Env) -> None:
    for dsn in (env.services.postgres_dsn, env.peer_dsn):
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ANALYZE")
        finally:
            await conn.close()


async def time_calls(call: Callable[[], Awaitable[Any]], samples: int) -> list[float]:
    await call()
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


async def reads(env: Env, section: Section, pool: AsyncConnectionPool[Any]) -> None:
    section.table(
        "reads",
        "Latest checkpoint: ALMA's resume path vs `aget_tuple` (5 KB)",
        [
            "checkpoints in run",
            "ALMA resume, cached p50 ms",
            "p99 ms",
            "ALMA resume, PostgreSQL p50 ms",
            "p99 ms",
            "LangGraph aget_tuple p50 ms",
            "p99 ms",
            "cached ÷ LangGraph p50",
            "PostgreSQL ÷ LangGraph p50",
        ],
    )
    state = realistic_state(5_000, seed=5)
    for count in (10, 1_000):
        env.step(f"reads, runs of {count} checkpoints")
        cols = await read_latest(env, pool, count, state)
        p50 = {k: Stat([pct(v, 50) * 1000 for v in runs]) for k, runs in cols.items()}
        p99 = {k: Stat([pct(v, 99) * 1000 for v in runs]) for k, runs in cols.items()}
        section.add(
            "reads",
            [
                count,
                p50["cached"],
                p99["cached"],
                p50["pg"],
                p99["pg"],
                p50["lg"],
                p99["lg"],
                ratio(p50["cached"], p50["lg"]),
                ratio(p50["pg"], p50["lg"]),
            ],
        )
        env.done()


async def read_latest(
    env: Env, pool: AsyncConnectionPool[Any], count: int, state: dict[str, Any]
) -> dict[str, list[list[float]]]:
    """Latencies of the latest read of a run of ``count`` checkpoints, per repetition:
    the SDK's resume (Redis), the same on a cache miss (PostgreSQL), ``aget_tuple``."""
    samples = env.fewer(60 if env.quick else 300)
    run = f"read-{count}-{uuid.uuid4().hex[:6]}"
    saver = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
    config = lg_config(run)
    for i in range(count):
        config = await lg_put(saver, config, {**state, "step": i}, i)
    ctx = WorkflowContext(tenant_id="bench", workflow_id="wf", run_id=run)
    latest = lg_config(run)
    cols: dict[str, list[list[float]]] = {"cached": [], "pg": [], "lg": []}
    async with AlmaClient(env.s) as cached, connect(env.services.postgres_dsn) as pg:
        alma = AlmaRun(pg, run)  # its latest() is what resume() does on a cache miss
        await alma.extend(count, state)
        await analyze(env)  # as autovacuum would have by now: plans for the tables' real size
        for _ in range(env.reps):
            cols["cached"].append(await time_calls(lambda: cached.resume(ctx), samples))
            cols["pg"].append(await time_calls(alma.latest, samples))
            cols["lg"].append(await time_calls(lambda: saver.aget_tuple(latest), samples))
        point = await cached.resume(ctx)
    tuple_ = await saver.aget_tuple(latest)
    if point.latest is None or point.latest.state.get("step") != count - 1:
        raise errors.AlmaError(f"ALMA's resume point is wrong: {point.latest}")
    if tuple_ is None or tuple_.checkpoint["channel_values"].get("step") != count - 1:
        raise errors.AlmaError("LangGraph's latest checkpoint is wrong")
    return cols


async def langgraph_saver_pool(dsn: str, size: int = 10) -> AsyncConnectionPool[Any]:
    """The pool LangGraph's docs prescribe (autocommit, dict rows), tables set up."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn.replace("postgresql://", "postgres://", 1),
        min_size=size,
        max_size=size,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    await pool.open(wait=True)
    await AsyncPostgresSaver(pool).setup()  # type: ignore[arg-type]
    return pool


async def capacity(env: Env, section: Section, pool: AsyncConnectionPool[Any]) -> None:
    """Checkpoints per second at saturation, where offered load exceeds what either
    carries: ALMA draining a backlog (records always waiting: full batches) and
    LangGraph's ``aput`` from 50 writers at once on its pool (more writers only queue
    for its connections), paired in each repetition."""
    section.table(
        "capacity",
        "Capacity at saturation: ALMA drains a backlog (one checkpointer) vs LangGraph "
        "`aput` from 50 writers flat out",
        ["state", "ALMA checkpoints/s", "LangGraph checkpoints/s", "ALMA ÷ LangGraph"],
    )
    for size in (1_000, 5_000, 100_000):
        state = realistic_state(size, seed=size)
        big = size > 50_000
        backlog = env.fewer((500 if big else 4_000) if env.quick else (1_000 if big else 10_000))
        each = env.fewer((4 if big else 10) if env.quick else (6 if big else 30))
        alma, lg = [], []
        for _ in range(env.reps):
            env.step(f"capacity {size // 1000} KB")
            alma.append(await throughput(env.s, env.services, backlog, size, state))
            lg.append(figures(*await langgraph_writes(pool, state, 50, each))["per_s"])
            env.done()
        a, b = Stat(alma, 0), Stat(lg, 0)
        section.add("capacity", [f"{size // 1000} KB", a, b, ratio(a, b)])


async def run(env: Env, section: Section) -> None:
    pool = await langgraph_saver_pool(env.peer_dsn)
    try:
        await writes(env, section, pool)
        await capacity(env, section, pool)
        await reads(env, section, pool)
    finally:
        await pool.close()


# --- what the tables say, from the same run -------------------------------------------


def _row(section: Section, key: str, **match: object) -> dict[str, Any] | None:
    """The first row of table ``key`` whose columns (named by their headers, spaces as
    underscores) equal ``match``."""
    table = section.tables.get(key)
    if table is None:
        return None
    names = [h.replace(" ", "_") for h in table["headers"]]
    for row in table["rows"]:
        cells = dict(zip(names, row, strict=True))
        if all(cells.get(k) == v for k, v in match.items()):
            return dict(zip(table["headers"], row, strict=True))
    return None


def _x(value: object) -> str:
    return f"{value.median:.2f}×" if isinstance(value, Stat) else str(value)


def _ms(value: object) -> str:
    return f"{value.median:.1f} ms" if isinstance(value, Stat) else str(value)


def _verdict(value: object, target: float, at_least: bool) -> str:
    if not isinstance(value, Stat):
        return "not measured"
    met = value.median >= target if at_least else value.median <= target
    return f"target {'≥' if at_least else '≤'} {target}×: {'met' if met else 'missed'}"


def notes(section: Section, broker: str = "tansu") -> None:
    """Sentences under the tables, every figure read from this run's rows (so the text
    cannot drift from the table it sits under), each true of ``broker`` (``tansu`` or
    ``kafka``, bench.env's BrokerKind)."""
    alma, lg, hop = (
        _row(section, "writes", state="5 KB", writers=1, system=s)
        for s in ("ALMA", "LangGraph", HOP)
    )
    if alma is not None and lg is not None and hop is not None:
        section.note(
            "writes",
            f"From this run: one writer waits {_ms(alma['p50 ms'])} p50 for a 5 KB checkpoint "
            f"through ALMA against LangGraph's {_ms(lg['p50 ms'])}; the Kafka hop alone takes "
            f"{_ms(hop['p50 ms'])} of it on this broker ("
            + (
                "a waiting fetch is not woken by new data)."
                if broker == "tansu"
                else "which answers a waiting fetch as soon as data arrives)."
            ),
        )
    for size in ("5 KB", "100 KB"):
        ratio_row = _row(section, "write_ratio", state=size, writers="50")
        if ratio_row is not None:
            section.note(
                "write_ratio",
                f"- {size}, 50 writers: ALMA carries {_x(ratio_row['throughput ×'])} "
                f"LangGraph's checkpoints/s, at {_x(ratio_row['p50 ×'])} its p50.",
            )
        ceiling = _row(section, "ceiling", state=size, writers=50)
        if ceiling is not None:
            mine = ceiling["ALMA ÷ durable hop"]
            section.note(
                "ceiling",
                f"- {size}, 50 writers: the least durable consumer carries "
                f"{_x(ceiling['durable hop ÷ LangGraph'])} LangGraph's checkpoints/s; ALMA "
                f"carries {_x(mine)} of it ({_verdict(mine, 0.9, True)}), "
                f"{_x(ceiling['ALMA, own process ÷ durable hop'])} with the checkpointer in "
                "its own process.",
            )
    for size in ("5 KB", "100 KB"):
        codec = _row(section, "codec", state=size, writers=50, system="ALMA")
        floor = _row(section, "codec", state=size, writers=50, system=DURABLE_HOP)
        if codec is not None and floor is not None:
            section.note(
                "codec",
                f"- {size}: with {CODEC}, ALMA carries {_x(codec['checkpoints/s ×'])} the "
                f"checkpoints/s it carries uncompressed, at {_x(codec['CPU per checkpoint ×'])} "
                f"the CPU per checkpoint; the least durable consumer "
                f"{_x(floor['checkpoints/s ×'])}, at {_x(floor['CPU per checkpoint ×'])}.",
            )
    for size in ("1 KB", "5 KB", "100 KB"):
        cap = _row(section, "capacity", state=size)
        if cap is not None:
            target = (
                " (" + _verdict(cap["ALMA ÷ LangGraph"], 3.0, True) + ")" if size == "1 KB" else ""
            )
            section.note(
                "capacity",
                f"- {size}: ALMA drains {_x(cap['ALMA ÷ LangGraph'])} what LangGraph's "
                f"`aput` carries{target}.",
            )
    for count in (10, 1000):
        read = _row(section, "reads", checkpoints_in_run=count)
        if read is not None:
            section.note(
                "reads",
                f"- {count:,} checkpoints: the resume read takes "
                f"{_x(read['cached ÷ LangGraph p50'])} `aget_tuple`'s p50 from the cache, "
                f"{_x(read['PostgreSQL ÷ LangGraph p50'])} from PostgreSQL.",
            )
    merge = _row(section, "merge", branches=5)
    if merge is not None:
        section.note(
            "merge",
            f"ALMA's merge costs {_x(merge['ALMA ÷ LangGraph'])} LangGraph's reducer step "
            f"({_verdict(merge['ALMA ÷ LangGraph'], 2.0, False)}): the reducers, then the "
            "state's canonical JSON and its hash, which the checkpoint stores.",
        )
