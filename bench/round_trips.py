"""The checkpointer's first round trip (issue 54): the offsets' fence, the runs' locks
and the batch's reads in one statement (``locked.fence_and_load``), against the three
statements they were before (the fence, then ``lock_runs``, then ``load_locked``: the
path a batch still takes when a lock it waited on makes its snapshot stale).

Both run in one process, on one stack, alternating within each repetition (the order
swapped every other one), through the same closed loop as the peers' table
(:func:`bench.peers.alma_writes`: publish a 5 KB ``node.completed``, wait until it is
durable and cached, publish the next); ratios pair the repetitions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from alma_core.storage.batches import BatchStore
from alma_core.storage.checkpoints import PostgresCheckpointStore
from bench.env import Env
from bench.peers import alma_writes, figures, realistic_state
from bench.report import Section, Stat, ratio

ONE = "fence, locks and reads: one statement"
THREE = "three statements (before)"
STEPS = 2  # one per writer count


async def run(env: Env, section: Section) -> None:
    section.table(
        "round_trips",
        "The checkpointer's first round trip: one statement against three (5 KB, "
        "publish → durable and cached)",
        ["writers", "first round trip", "checkpoints/s", "p50 ms", "p99 ms"],
    )
    section.table(
        "round_trips_ratio",
        "One statement ÷ three (paired repetitions)",
        ["writers", "throughput ×", "p50 ×", "p99 ×"],
    )
    state = realistic_state(5_000, seed=5_000)
    one: Callable[..., Awaitable[Any]] = PostgresCheckpointStore.open
    ways = {ONE: one, THREE: BatchStore.open}
    sentences = []
    for writers, each in ((1, env.fewer(150)), (50, env.fewer(40))):
        got: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
        for rep in range(env.reps):
            env.step(f"round trips: {writers} writers")
            order = list(ways.items()) if rep % 2 == 0 else list(ways.items())[::-1]
            for name, opening in order:
                PostgresCheckpointStore.open = opening  # type: ignore[method-assign,assignment]
                try:
                    latencies, elapsed = await alma_writes(env, state, writers, each)
                finally:
                    PostgresCheckpointStore.open = one  # type: ignore[method-assign,assignment]
                got[name].append(figures(latencies, elapsed))
        env.done()
        stats = {
            name: {k: Stat([f[k] for f in runs], 0 if k == "per_s" else 1) for k in runs[0]}
            for name, runs in got.items()
        }
        for name, s in stats.items():
            section.add("round_trips", [writers, name, s["per_s"], s["p50"], s["p99"]])
        paired = {
            k: ratio(
                Stat([f[k] for f in got[ONE]]),
                Stat([f[k] for f in got[THREE]]),
            )
            for k in ("per_s", "p50", "p99")
        }
        section.add("round_trips_ratio", [writers, paired["per_s"], paired["p50"], paired["p99"]])
        sentences.append(
            f"{writers} writer{'s' if writers > 1 else ''}: "
            f"{paired['per_s'].median:.2f}× the throughput, {paired['p50'].median:.2f}× the p50"
        )
    section.note(
        "round_trips_ratio",
        f"One statement instead of three, two round trips fewer per batch; from this run: "
        f"{'; '.join(sentences)}.",
    )
