"""The embedded hop: what `alma up`'s fetch wait costs idle and buys in latency.

The embedded broker does not wake a waiting fetch when data arrives, so each Kafka hop
costs about half of ``ALMA_FETCH_MAX_WAIT_MS``; a shorter wait answers sooner and polls
more often when nothing happens. For each wait: `alma up` as a user runs it (every
service embedded, every worker, in a scratch directory), left alone to settle, then

* idle CPU: the CPU time of `alma up` and everything it started (the broker,
  PostgreSQL, Redis, the workers) over an idle stretch, as a share of one core;
* one writer's latency: ``node.completed`` then ``applied()``, one after another, p50
  and p95 (a checkpoint durable and confirmed, through the checkpointer's hop);
* the first write after a quiet spell (``QUIET_S``): what the idle pace
  (``ALMA_FETCH_IDLE_WAIT_MS``: a long fetch wait once a consumer had no record for 2 s)
  costs the write that ends it.

Each fetch wait is measured without the idle pace, and `alma up`'s default with it.
The choice: the lowest p50 whose idle CPU stays within ``IDLE_BUDGET`` of one core.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import psutil

from alma_core import settings as settings_mod
from alma_core.sdk.client import AlmaClient
from alma_core.types import WorkflowContext
from bench.env import Env, scratch
from bench.report import Section, Stat, pct
from bench.soak import alma_up

WAITS_MS = (100, 50, 20, 10, 5, 2)
IDLE_WAITS_MS = (500, 2_000)  # the idle pace's long waits tried, `alma up`'s among them
IDLE_BUDGET = 0.02  # of one core
QUIET_S = 3.0
STEPS_PER_WAIT = 1


def _default(env: Env) -> tuple[int, int]:
    """`alma up`'s own (fetch wait, idle wait) on the broker measured
    (:func:`alma_core.settings.for_broker`): the in-memory Tansu's, or on Apache Kafka
    the settings' fetch wait (Kafka answers a waiting fetch when data arrives), both
    with the same idle wait."""
    idle = settings_mod.EMBEDDED_FETCH_IDLE_WAIT_MS
    if env.broker_kind == "tansu":
        return settings_mod.EMBEDDED_FETCH_MAX_WAIT_MS, idle
    return int(settings_mod.Settings.model_fields["fetch_max_wait_ms"].default), idle


def _waits(env: Env) -> list[tuple[int, int]]:
    """(fetch wait, idle wait) pairs: each wait without the idle pace (`alma up`'s
    default among them), then `alma up`'s fetch wait with each idle wait tried that is
    longer than it (its default among them)."""
    fetch, idle_default = _default(env)
    busy = WAITS_MS[2:4] if env.smoke else WAITS_MS
    busy = tuple(sorted({*busy, fetch} if idle_default == 0 else set(busy), reverse=True))
    idle = sorted(i for i in {*IDLE_WAITS_MS, idle_default} if i > fetch)
    return [(w, 0) for w in busy] + [(fetch, i) for i in idle]


def _cpu_seconds(pid: int) -> float:
    """CPU seconds so far of ``pid`` and its descendants (ended ones: reaped times)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


async def _idle_share(pid: int, seconds: float) -> float:
    before = _cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (_cpu_seconds(pid) - before) / seconds


async def _writes(
    up: dict[str, object], wait_ms: int, n: int, quiet: int
) -> tuple[list[float], list[float]]:
    """One writer's write latencies back to back, and ``quiet`` writes each after
    ``QUIET_S`` without any."""
    s = settings_mod.load(
        kafka_bootstrap=str(up["kafka_bootstrap"]),
        postgres_dsn=str(up["postgres_dsn"]),
        redis_url=str(up["redis_url"]),
        fetch_max_wait_ms=wait_ms,
        require_tenant=False,
        metrics_port=0,
    )
    ms: list[float] = []
    after_quiet: list[float] = []
    async with AlmaClient(s) as client:
        ctx = WorkflowContext("hop", "hop", None, f"hop-{uuid.uuid4().hex[:8]}", "n")

        async def write(i: int) -> float:
            started = time.perf_counter()
            await client.node_completed(ctx, updates={"i": i}, wait="applied")
            return (time.perf_counter() - started) * 1000

        for i in range(n + 5):  # the first few open connections and listeners
            took = await write(i)
            if i >= 5:
                ms.append(took)
        for i in range(quiet):
            await asyncio.sleep(QUIET_S)
            after_quiet.append(await write(n + 5 + i))
    return ms, after_quiet


async def run(env: Env, section: Section) -> None:
    section.table(
        "hop",
        "The embedded hop: `alma up`'s fetch wait, idle CPU and one writer's latency",
        [
            "ALMA_FETCH_MAX_WAIT_MS",
            "ALMA_FETCH_IDLE_WAIT_MS",
            "idle CPU (% of one core)",
            "write p50 ms",
            "write p95 ms",
            f"first write after {QUIET_S:g} s quiet, ms",
        ],
    )
    settle_s, idle_s, n, quiet = (5.0, 5.0, 10, 1) if env.smoke else (20.0, 30.0, 100, 5)
    figures: dict[tuple[int, int], tuple[Stat, Stat, Stat, Stat]] = {}
    for wait, idle_wait in _waits(env):
        idle, p50, p95, first = [], [], [], []
        for _ in range(env.reps):
            env.step(f"hop: alma up, fetch wait {wait} ms, idle {idle_wait} ms")
            given = {
                "ALMA_FETCH_MAX_WAIT_MS": str(wait),
                "ALMA_FETCH_IDLE_WAIT_MS": str(idle_wait),
                "ALMA_EMBEDDED_BROKER": env.broker_kind,
            }
            with scratch("alma-hop-") as root:
                async with alma_up(root, given) as up:
                    await asyncio.sleep(settle_s)
                    idle.append(100 * await _idle_share(int(str(up["pid"])), idle_s))
                    ms, after_quiet = await _writes(up, wait, n, quiet)
                    p50.append(pct(ms, 50))
                    p95.append(pct(ms, 95))
                    first.append(pct(after_quiet, 50))
        env.done(STEPS_PER_WAIT)
        figures[(wait, idle_wait)] = (Stat(idle, 2), Stat(p50, 1), Stat(p95, 1), Stat(first, 1))
        shown_idle = idle_wait if idle_wait > wait else "off"
        section.add("hop", [wait, shown_idle, *figures[(wait, idle_wait)]])
    within = [k for k, f in figures.items() if f[0].median <= IDLE_BUDGET * 100]
    best = min(within, key=lambda k: figures[k][1].median) if within else None
    default = _default(env)
    d_idle, d_p50, _, d_first = figures[default]
    plain = figures.get((default[0], 0))
    choice = (
        f"the lowest p50 within {IDLE_BUDGET:.0%} of one core idle is {best[0]} ms with the "
        f"idle pace {'on' if best[1] else 'off'} ({figures[best][1].median:.1f} ms p50, "
        f"{figures[best][0].median:.2f} % idle)"
        if best is not None
        else f"no setting keeps idle CPU within {IDLE_BUDGET:.0%} of one core"
    )
    than = (
        f" (without it, {plain[0].median:.2f} % idle and {plain[1].median:.1f} ms p50)"
        if plain and default[1]
        else ""
    )
    paced = f"{default[1]} ms once idle" if default[1] else "no idle pace"
    section.note(
        "hop",
        f"`alma up` in a scratch directory, left {settle_s:g} s to settle; idle CPU of it "
        f"and everything it started over {idle_s:g} s; {n} writes of one writer, one after "
        f"another (`node.completed`, then `applied()`), then {quiet} writes each after "
        f"{QUIET_S:g} s without any. From this run: {choice}. `alma up`'s default, "
        f"{default[0]} ms and {paced}, costs {d_idle.median:.2f} % of one "
        f"core idle with {d_p50.median:.1f} ms p50 under load{than}; the first write after a "
        f"quiet spell takes {d_first.median:.1f} ms.",
    )
