"""Replay to verify, and a fork: how fast ``alma replay`` re-folds recorded events and
compares the checkpoints, and what a fork costs.

The workload: runs of 50 ``node.completed`` events, each ``updates`` of a ~1 KB text and
a step counter (so the replay folds every one with the reducers: nothing is taken from
a stored state), written by the checkpointer's own store (what the pipeline writes,
without the broker) into a database of their own, in batches of 250 events.

* Replay to verify: every run loaded in one snapshot (its events, checkpoints and
  reducers), folded and compared, as ``alma replay --all`` does; events per second.
* The fold alone (pure code, the inputs already in memory): events per second.
* A fork through a running checkpointer (``Timeline(client).fork``: read the state,
  publish, wait until applied); its latency.
"""

from __future__ import annotations

import json
import random
import string
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg

from alma_core import replay as replaying
from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerRegistry
from alma_core.schemas.decoder import decode
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.timeline import Timeline
from alma_core.storage import postgres, replays
from alma_core.storage.batches import Incoming
from alma_core.storage.checkpoints import PostgresCheckpointStore, StoreConfig
from alma_core.types import WorkflowContext
from bench.env import Env, alma_workers
from bench.report import Section, Stat, pct

EVENTS_PER_RUN = 50
BATCH = 250
STEPS_PER_REP = 3
REGISTRY = ReducerRegistry()


def _events(env: Env) -> int:
    if env.smoke:
        return 1_000
    return 100_000 if env.quick else 1_000_000


def _text() -> str:
    return "".join(random.choices(string.ascii_letters, k=1000))


def run_docs(run: str) -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat()
    base = {"emitted_at": now, "tenant_id": "bench", "workflow_id": "wf", "run_id": run}
    return [
        {
            **base,
            "event_id": uuid.uuid4().hex,
            "type": "node.completed",
            "node_id": f"n{i}",
            "payload": {
                "updates": {
                    "step": i,
                    "text": "".join(random.choices(string.ascii_letters, k=1000)),
                }
            },
        }
        for i in range(EVENTS_PER_RUN)
    ]


async def _write(pool: asyncpg.Pool, runs: int) -> None:
    store = PostgresCheckpointStore(pool, StoreConfig("r", "r", "x", "y", 10**9), REGISTRY)
    offset, records = 0, []
    for r in range(runs):
        for doc in run_docs(f"replay-{r}"):
            raw = json.dumps(doc).encode()
            records.append(Incoming("r", 0, offset, doc["run_id"].encode(), raw, decode(raw)))
            offset += 1
        if len(records) >= BATCH:
            await store.transact("c-r", {("r", 0): records}, TenantLimits())
            records = []
    if records:
        await store.transact("c-r", {("r", 0): records}, TenantLimits())


async def _replay_all(dsn: str) -> tuple[float, float, int]:
    """Seconds for the whole replay, seconds of the fold alone, events replayed."""
    fold_s, events = 0.0, 0
    pool = await postgres.create_pool(dsn, min_size=1, max_size=1)
    try:
        started = time.perf_counter()
        async with pool.acquire() as conn:
            async for tenant, run in replays.chosen(conn, tenant_id="bench"):
                inputs = await replays.load(conn, tenant, run)
                assert inputs is not None
                folding = time.perf_counter()
                verdict = replaying.replay(
                    inputs.run,
                    inputs.events,
                    inputs.stored,
                    config=inputs.config,
                    registry=REGISTRY,
                    max_state_bytes=10**7,
                )
                fold_s += time.perf_counter() - folding
                if verdict.difference is not None:
                    raise RuntimeError(f"replay differs: {verdict.to_doc()}")
                events += verdict.events
        return time.perf_counter() - started, fold_s, events
    finally:
        await pool.close()


async def _forks(env: Env, n: int) -> list[float]:
    """Latency of ``n`` forks of one run through a running checkpointer."""
    topic = await env.topic("replay-forks")
    async with alma_workers(env, topic) as s, AlmaClient(s) as client:
        source = WorkflowContext("bench", "wf", None, f"src-{uuid.uuid4().hex[:6]}", "n0")
        for i in range(3):
            await client.applied(
                source, await client.node_completed(source, updates={"step": i, "x": "y" * 1000})
            )
        seconds, timeline = [], Timeline(client)
        for i in range(n):
            started = time.perf_counter()
            await timeline.fork(source, 2, f"{source.run_id}-fork-{i}")
            seconds.append(time.perf_counter() - started)
        return seconds


async def run(env: Env, section: Section) -> None:
    section.table(
        "replay",
        "Replay to verify (runs of 50 events, 1 KB states) and a fork",
        ["what", "events", "events/s", "p50 ms", "p99 ms"],
    )
    events = _events(env)
    forks = 2 if env.smoke else (20 if env.quick else 50)
    whole, fold, fork_ms = [], [], []
    for _ in range(env.reps):
        async with env.database("replay") as dsn:
            pool = await postgres.create_pool(dsn, min_size=1, max_size=2)
            try:
                env.step(f"replay: writing {events:,} events")
                await _write(pool, events // EVENTS_PER_RUN)
                env.done()
            finally:
                await pool.close()
            env.step(f"replay: verifying {events:,} events")
            total_s, fold_s, replayed = await _replay_all(dsn)
            whole.append(replayed / total_s)
            fold.append(replayed / fold_s)
            env.done()
        env.step(f"replay: {forks} forks")
        fork_ms.append([s * 1000 for s in await _forks(env, forks)])
        env.done()
    section.add(
        "replay", ["replay to verify (load, fold, compare)", f"{events:,}", Stat(whole, 0), "", ""]
    )
    section.add("replay", ["the fold alone (pure)", f"{events:,}", Stat(fold, 0), "", ""])
    section.add(
        "replay",
        [
            "a fork (read, publish, applied)",
            "",
            "",
            Stat([pct(r, 50) for r in fork_ms], 1),
            Stat([pct(r, 99) for r in fork_ms], 1),
        ],
    )
    section.note(
        "replay",
        f"{events // EVENTS_PER_RUN:,} runs written by the checkpointer's store into a "
        "database of their own; replay reads each run in one snapshot on one connection "
        f"and folds it on the same 2 cores as PostgreSQL. {forks} forks of one run, one "
        "after another, through a checkpointer on the embedded broker "
        "(ALMA_FETCH_MAX_WAIT_MS=50). From this run: replay verifies "
        f"{Stat(whole).median:,.0f} events/s, of which the fold alone would allow "
        f"{Stat(fold).median:,.0f}/s (the rest is reading); 1 M events take "
        f"{1_000_000 / Stat(whole).median:,.0f} s; a fork costs "
        f"{Stat([pct(r, 50) for r in fork_ms]).median:.1f} ms p50.",
    )
