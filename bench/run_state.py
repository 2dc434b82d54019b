"""Run state with semantic keys, concurrent writers on one run: ALMA Stream's
``RunState`` (``updates`` folded by the run's single writer with ``sum`` and
``append``) versus the workflow state seed's JSONB column, written the seed's way
(read the value, change it, ``UPDATE ... SET state = state || $1``) and with the
atomic SQL a careful team would write instead (``jsonb_set`` in one statement).

Each writer increments a counter and records an action, ``ops`` times; at the end
the counter should be writers × ops and the action list as long: what is missing
was lost."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from alma_core.sdk.client import AlmaClient
from alma_core.sdk.run_state import RunState
from alma_core.types import WorkflowContext
from bench.env import Env, Waiters, checkpoint_worker
from bench.report import Section, Stat, pct, ratio

TABLE = """CREATE TABLE IF NOT EXISTS workflow_runs (
    id bigint PRIMARY KEY, state jsonb DEFAULT '{}', updated_at timestamptz DEFAULT now())"""
# The seed's update_workflow_state, verbatim but for the driver's placeholder.
SEED_UPDATE = (
    "UPDATE workflow_runs SET state = COALESCE(state, '{}'::jsonb) || $1::jsonb, "
    "updated_at = NOW() WHERE id = $2"
)
ATOMIC_INCREMENT = (
    "UPDATE workflow_runs SET state = jsonb_set(COALESCE(state, '{}'), "
    "'{count}', to_jsonb(COALESCE((state->>'count')::bigint, 0) + 1)) "
    "WHERE id = $1"
)
ATOMIC_APPEND = (
    "UPDATE workflow_runs SET state = jsonb_set(COALESCE(state, '{}'), '{actions}', "
    "COALESCE(state->'actions', '[]') || jsonb_build_array($2::text)) "
    "WHERE id = $1"
)
Writer = Callable[[int, int], Awaitable[None]]


class SeedState:
    """The seed's helper: every write reads the state first, then merges a key."""

    def __init__(self, pool: asyncpg.Pool, run: int) -> None:
        self.pool, self.run = pool, run

    async def get_all(self) -> dict[str, Any]:
        raw = await self.pool.fetchval("SELECT state FROM workflow_runs WHERE id = $1", self.run)
        return dict(json.loads(raw)) if raw else {}

    async def increment(self, key: str) -> None:
        state = await self.get_all()
        await self.pool.execute(SEED_UPDATE, json.dumps({key: state.get(key, 0) + 1}), self.run)

    async def record_action(self, name: str) -> None:
        state = await self.get_all()
        actions = [*state.get("actions", []), name]
        await self.pool.execute(SEED_UPDATE, json.dumps({"actions": actions}), self.run)


async def contend(writers: int, ops: int, write: Writer) -> tuple[list[float], float]:
    latencies: list[float] = []

    async def one(w: int) -> None:
        for i in range(ops):
            started = time.perf_counter()
            await write(w, i)
            latencies.append((time.perf_counter() - started) / 2)  # two writes per op

    started = time.perf_counter()
    await asyncio.gather(*(one(w) for w in range(writers)))
    return latencies, time.perf_counter() - started


async def jsonb(env: Env, writers: int, ops: int, atomic: bool) -> dict[str, float]:
    pool = await asyncpg.create_pool(env.peer_dsn, min_size=writers, max_size=writers)
    try:
        await pool.execute(TABLE)
        run = int(await pool.fetchval("SELECT coalesce(max(id), 0) + 1 FROM workflow_runs"))
        await pool.execute("INSERT INTO workflow_runs (id) VALUES ($1)", run)
        seed = SeedState(pool, run)

        async def write(w: int, i: int) -> None:
            if atomic:
                await pool.execute(ATOMIC_INCREMENT, run)
                await pool.execute(ATOMIC_APPEND, run, f"w{w}-{i}")
            else:
                await seed.increment("count")
                await seed.record_action(f"w{w}-{i}")

        latencies, elapsed = await contend(writers, ops, write)
        final = await seed.get_all()
    finally:
        await pool.close()
    return outcome(latencies, elapsed, final, writers * ops)


async def alma(env: Env, writers: int, ops: int) -> dict[str, float]:
    topic = await env.topic("rs")
    s = env.settings_for(topic, fetch_max_wait_ms=20)
    ctx = WorkflowContext(tenant_id="bench", workflow_id=f"wf-{topic}", run_id=topic)
    async with checkpoint_worker(s, env.services, Waiters().on_done), AlmaClient(s) as client:
        states = [
            RunState(client, ctx, counters=("count",), writer=f"w{w}") for w in range(writers)
        ]

        async def write(w: int, i: int) -> None:
            await states[w].increment("count")
            await states[w].record_action(f"w{w}-{i}")

        latencies, elapsed = await contend(writers, ops, write)
        final = await states[0].get_all()
    return outcome(latencies, elapsed, final, writers * ops)


def outcome(
    latencies: list[float], elapsed: float, final: dict[str, Any], expected: int
) -> dict[str, float]:
    return {
        "per_s": 2 * expected / elapsed,
        "p50": pct(latencies, 50) * 1000,
        "p99": pct(latencies, 99) * 1000,
        "lost_count": expected - int(final.get("count", 0)),
        "lost_actions": expected - len(final.get("actions", [])),
    }


async def run(env: Env, section: Section) -> None:
    section.table(
        "run_state",
        "Run state, concurrent writers on one run: each increments a counter and records an action",
        [
            "writers × ops",
            "system",
            "writes/s",
            "p50 ms per write",
            "p99 ms",
            "lost increments",
            "lost actions",
        ],
    )
    section.table(
        "run_state_ratio",
        "Run state, ALMA ÷ seed's JSONB read-modify-write",
        ["writers × ops", "throughput ×", "p50 ×"],
    )
    for writers, quick_ops in ((4, 10), (16, 5)) if env.quick else ((4, 25), (16, 10)):
        ops = env.fewer(quick_ops)
        got: dict[str, list[dict[str, float]]] = {
            "ALMA RunState (updates)": [],
            "JSONB, seed's read-modify-write": [],
            "JSONB, atomic jsonb_set": [],
        }
        for _ in range(env.reps):
            env.step(f"run state, {writers} writers")
            got["ALMA RunState (updates)"].append(await alma(env, writers, ops))
            got["JSONB, seed's read-modify-write"].append(await jsonb(env, writers, ops, False))
            got["JSONB, atomic jsonb_set"].append(await jsonb(env, writers, ops, True))
            env.done()
        for system, runs in got.items():
            section.add(
                "run_state",
                [
                    f"{writers} × {ops}",
                    system,
                    *(
                        Stat([r[k] for r in runs], d)
                        for k, d in (
                            ("per_s", 0),
                            ("p50", 1),
                            ("p99", 1),
                            ("lost_count", 0),
                            ("lost_actions", 0),
                        )
                    ),
                ],
            )
        a = {k: Stat([r[k] for r in got["ALMA RunState (updates)"]]) for k in ("per_s", "p50")}
        j = {
            k: Stat([r[k] for r in got["JSONB, seed's read-modify-write"]])
            for k in ("per_s", "p50")
        }
        section.add(
            "run_state_ratio",
            [f"{writers} × {ops}", ratio(a["per_s"], j["per_s"]), ratio(a["p50"], j["p50"])],
        )
    section.note(
        "run_state",
        "Lost = expected − found at the end of a repetition "
        f"(each figure: median, then lowest–highest of {env.reps} repetitions).",
    )
