"""The checkpointer's first round trip (issue 54): the offsets' fence, the runs' locks
and the batch's reads in one statement (``locked.fence_and_load``), against the three
statements they were before (the fence, then ``lock_runs``, then ``load_locked``: the
path a batch still takes when a lock it waited on makes its snapshot stale).

Both run in one process, on one stack, alternating within each repetition (the order
swapped every other one), through the same closed loop as the peers' table
(:func:`bench.peers.alma_writes`: publish a 5 KB ``node.completed``, wait until it is
durable and cached, publish the next); ratios pair the repetitions. Twice: with
PostgreSQL on this machine, and with PostgreSQL behind a proxy that delays each way
(:mod:`bench.netdelay`: a database across a network; its measured round trip is shown).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from alma_core.storage.batches import BatchStore
from alma_core.storage.checkpoints import PostgresCheckpointStore
from bench.env import Env
from bench.netdelay import delayed, measured_rtt_ms
from bench.peers import alma_writes, figures, realistic_state
from bench.report import Section, Stat, ratio

ONE = "one statement"
THREE = "three statements (before)"
DELAY_MS = 0.5  # each way, asked of the proxy (its timers round it up to about 1 ms)
WRITERS = (1, 50)
STEPS = 2 * len(WRITERS)  # one per writer count and placement


async def run(env: Env, section: Section) -> None:
    section.table(
        "round_trips",
        "The checkpointer's first round trip: the fence, the runs' locks and the reads in "
        "one statement against three (5 KB, publish → durable and cached)",
        ["PostgreSQL", "writers", "first round trip", "checkpoints/s", "p50 ms", "p99 ms"],
    )
    section.table(
        "round_trips_ratio",
        "One statement ÷ three (paired repetitions)",
        ["PostgreSQL", "writers", "throughput ×", "p50 ×", "p99 ×"],
    )
    sentences = []
    local = await measured_rtt_ms(env.services.postgres_dsn)
    sentences += await _compare(env, section, f"on this machine ({local:.2f} ms a round trip)")
    async with delayed(env.services.postgres_dsn, DELAY_MS) as dsn:
        away = dataclasses.replace(
            env,
            s=env.s.model_copy(update={"postgres_dsn": dsn}),
            services=dataclasses.replace(env.services, postgres_dsn=dsn),
        )
        rtt = await measured_rtt_ms(dsn)
        sentences += await _compare(away, section, f"behind a proxy ({rtt:.2f} ms a round trip)")
    section.note(
        "round_trips_ratio",
        "One statement instead of three, two round trips fewer per batch; from this run: "
        f"{'; '.join(sentences)}.",
    )


async def _compare(env: Env, section: Section, where: str) -> list[str]:
    state = realistic_state(5_000, seed=5_000)
    one: Callable[..., Awaitable[Any]] = PostgresCheckpointStore.open
    ways = {ONE: one, THREE: BatchStore.open}
    sentences = []
    for writers in WRITERS:
        each = env.fewer(150 if writers == 1 else 40)
        got: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
        for rep in range(env.reps):
            env.step(f"round trips: {writers} writers, PostgreSQL {where.split(' (')[0]}")
            order = list(ways.items()) if rep % 2 == 0 else list(ways.items())[::-1]
            for name, opening in order:
                PostgresCheckpointStore.open = opening  # type: ignore[method-assign,assignment]
                try:
                    latencies, elapsed = await alma_writes(env, state, writers, each)
                finally:
                    PostgresCheckpointStore.open = one  # type: ignore[method-assign,assignment]
                got[name].append(figures(latencies, elapsed))
        env.done()
        for name, runs in got.items():
            s = {k: Stat([f[k] for f in runs], 0 if k == "per_s" else 1) for k in runs[0]}
            section.add("round_trips", [where, writers, name, s["per_s"], s["p50"], s["p99"]])
        paired = {
            k: ratio(Stat([f[k] for f in got[ONE]]), Stat([f[k] for f in got[THREE]]))
            for k in ("per_s", "p50", "p99")
        }
        section.add(
            "round_trips_ratio", [where, writers, paired["per_s"], paired["p50"], paired["p99"]]
        )
        sentences.append(
            f"PostgreSQL {where}, {writers} writer{'s' if writers > 1 else ''}: "
            f"{paired['per_s'].median:.2f}× the throughput, {paired['p50'].median:.2f}× the p50"
        )
    return sentences
