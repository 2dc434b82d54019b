"""Round trips of the checkpointer's batch (issue 54), two ways against each other, in
one process, on one stack, alternating within each repetition (the order swapped every
other one), through the same closed loop as the peers' table
(:func:`bench.peers.alma_writes`: publish a 5 KB ``node.completed``, wait until it is
durable and cached, publish the next); ratios pair the repetitions. Twice: with
PostgreSQL on this machine, and with PostgreSQL behind a proxy that delays each way
(:mod:`bench.netdelay`: a database across a network; its measured round trip is shown).

* ``round-trips``: the transaction's first round trip, the offsets' fence, the runs'
  locks and the batch's reads in one statement (``locked.fence_and_load``), against the
  three statements they were before (the fence, ``lock_runs``, ``load_locked``).
* ``unlocked``: the batch folded from the checkpointer's memory of its runs and written
  in one checked statement that commits alone (one round trip: the default), the same
  after a read without locks (two; ``ALMA_RUN_MEMORY_BYTES=0``), against the transaction
  under the runs' locks (four: ``BEGIN``, the first round trip, the write, ``COMMIT``;
  ``ALMA_UNLOCKED_READS=false``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from alma_core.storage.batches import BatchStore
from alma_core.storage.checkpoints import PostgresCheckpointStore
from bench.env import Env
from bench.netdelay import delayed, measured_rtt_ms
from bench.peers import alma_writes, figures, realistic_state
from bench.report import Section, Stat, ratio

DELAY_MS = 0.5  # each way, asked of the proxy (its timers round it up to about 1 ms)
WRITERS = (1, 50)
STEPS = 2 * len(WRITERS)  # one per writer count and placement


@dataclass(frozen=True)
class Comparison:
    """Two ways of the batch (``new`` against ``old``), each a context in which the
    closed loop runs, given the Env it runs on (and returning the Env to use)."""

    table: str  # the section's tables: ``table`` and ``table_ratio``
    title: str
    column: str  # what the ways differ in
    news: tuple[str, ...]  # each against ``old``
    old: str
    ways: dict[str, Callable[[Env], contextlib.AbstractContextManager[Env]]]
    note: str  # the ratio table's sentence, before the run's figures


def _with(**settings: Any) -> Callable[[Env], contextlib.AbstractContextManager[Env]]:
    """A way that runs the loop with these settings changed (none: as the Env is)."""

    @contextlib.contextmanager
    def way(env: Env) -> Iterator[Env]:
        yield dataclasses.replace(env, s=env.s.model_copy(update=settings))

    return way


_locked = _with(unlocked_reads=False)


@contextlib.contextmanager
def _three_statements(env: Env) -> Iterator[Env]:
    one = PostgresCheckpointStore.open
    PostgresCheckpointStore.open = BatchStore.open  # type: ignore[method-assign]
    try:
        with _locked(env) as on:
            yield on
    finally:
        PostgresCheckpointStore.open = one  # type: ignore[method-assign]


REMEMBERED = "remembered: write"
UNLOCKED_READ = "unlocked: read, write"
LOCKED = "locked: BEGIN, read, write, COMMIT"


ROUND_TRIPS = Comparison(
    table="round_trips",
    title="The checkpointer's first round trip: the fence, the runs' locks and the reads in "
    "one statement against three (5 KB, publish → durable and cached)",
    column="first round trip",
    news=("one statement",),
    old="three statements (before)",
    ways={"one statement": _locked, "three statements (before)": _three_statements},
    note="One statement instead of three, two round trips fewer per batch (both in a "
    "transaction under the runs' locks)",
)

UNLOCKED = Comparison(
    table="unlocked",
    title="The checkpointer's batch: read without locks and written in one checked statement "
    "that commits alone, against a transaction under the runs' locks (5 KB, publish → "
    "durable and cached)",
    column="batch",
    news=(REMEMBERED, UNLOCKED_READ),
    old=LOCKED,
    ways={REMEMBERED: _with(), UNLOCKED_READ: _with(run_memory_bytes=0), LOCKED: _locked},
    note="One checked write that commits alone, after a read without locks or none (the "
    "runs remembered): two round trips or one where the transaction takes four",
)


async def run(env: Env, section: Section) -> None:
    await _run(env, section, ROUND_TRIPS)


async def run_unlocked(env: Env, section: Section) -> None:
    with _with(unlocked_reads=True)(env) as on:
        await _run(on, section, UNLOCKED)


async def _run(env: Env, section: Section, c: Comparison) -> None:
    section.table(
        c.table,
        c.title,
        ["PostgreSQL", "writers", c.column, "checkpoints/s", "p50 ms", "p99 ms"],
    )
    section.table(
        f"{c.table}_ratio",
        f"Each ÷ {c.old} (paired repetitions)",
        ["PostgreSQL", "writers", c.column, "throughput ×", "p50 ×", "p99 ×"],
    )
    sentences = []
    local = await measured_rtt_ms(env.services.postgres_dsn)
    sentences += await _compare(env, section, f"on this machine ({local:.2f} ms a round trip)", c)
    async with delayed(env.services.postgres_dsn, DELAY_MS) as dsn:
        away = dataclasses.replace(
            env,
            s=env.s.model_copy(update={"postgres_dsn": dsn}),
            services=dataclasses.replace(env.services, postgres_dsn=dsn),
        )
        rtt = await measured_rtt_ms(dsn)
        sentences += await _compare(away, section, f"behind a proxy ({rtt:.2f} ms a round trip)", c)
    section.note(f"{c.table}_ratio", f"{c.note}; from this run: {'; '.join(sentences)}.")


async def _compare(env: Env, section: Section, where: str, c: Comparison) -> list[str]:
    state = realistic_state(5_000, seed=5_000)
    sentences = []
    for writers in WRITERS:
        each = env.fewer(150 if writers == 1 else 40)
        got: dict[str, list[dict[str, Any]]] = {name: [] for name in c.ways}
        for rep in range(env.reps):
            env.step(f"{c.table}: {writers} writers, PostgreSQL {where.split(' (')[0]}")
            order = list(c.ways.items()) if rep % 2 == 0 else list(c.ways.items())[::-1]
            for name, way in order:
                with way(env) as on:
                    latencies, elapsed = await alma_writes(on, state, writers, each)
                got[name].append(figures(latencies, elapsed))
        env.done()
        for name, runs in got.items():
            s = {k: Stat([f[k] for f in runs], 0 if k == "per_s" else 1) for k in runs[0]}
            section.add(c.table, [where, writers, name, s["per_s"], s["p50"], s["p99"]])
        for new in c.news:
            paired = {
                k: ratio(Stat([f[k] for f in got[new]]), Stat([f[k] for f in got[c.old]]))
                for k in ("per_s", "p50", "p99")
            }
            section.add(
                f"{c.table}_ratio",
                [where, writers, new, paired["per_s"], paired["p50"], paired["p99"]],
            )
            sentences.append(
                f"PostgreSQL {where}, {writers} writer{'s' if writers > 1 else ''}, {new}: "
                f"{paired['per_s'].median:.2f}× the throughput, "
                f"{paired['p50'].median:.2f}× the p50"
            )
    return sentences
