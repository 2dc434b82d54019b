"""Fairness between tenants (issue 50): tenant B sends a steady 50 events/s while
tenant A floods at 10× its rate quota; B's publish → checkpoint latency beside B's
alone, without a quota and with one; and A's flood, once lifted, all applied in order.

* Each tenant has its own lifecycle topic (ALMA_TENANT_TOPICS, 12 partitions each);
  one checkpointer (in this process, as the checkpointer suite's) reads both. The load
  comes from processes of their own (1 KB states over 200 runs per tenant, each record
  stamped with its send time); the latency is to the moment the checkpointer's batch
  is durable and cached.
* With the quota, A's events beyond it wait in the broker (its partitions paused), B's
  do not wait behind them. When the flood ends, A's quota is lifted with the setting
  `alma tenants set` writes (no restart) and its backlog drains; then every run of A is
  read back from PostgreSQL: each event applied once, in the order sent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg

from alma_core.cli.topics import ensure_topics
from alma_core.storage import tenant_settings
from bench.checkpointer import sent_at, start_load
from bench.env import PARTITIONS, Env, checkpoint_worker
from bench.report import Pooled, Section, Stat
from bench.stalls import MachineMeter, loop_lag

QUOTA = 100  # A's rate quota, events/s (burst: one second's worth)
FLOOD = 10  # A offers FLOOD × QUOTA events/s
B_RATE = 50
SIZE = 1_000
WARMUP_S = 1.0  # B's first second is left out: the worker's first queries, connections
MODES: tuple[tuple[str, bool, float], ...] = (
    ("B alone", False, QUOTA),
    ("A floods, not read (the machine's share)", True, -1),
    ("A floods, no quota", True, 0),
    ("A floods at 10× its quota", True, QUOTA),
)
STEPS_PER_REP = len(MODES)


def seconds(env: Env) -> float:
    return 3.0 if env.smoke else 10.0 if env.quick else 30.0


async def in_order(dsn: str, tenant: str) -> tuple[int, bool]:
    """How many of ``tenant``'s events were applied, and whether each of its runs holds
    them once each, in the order sent (the state's ``i`` rises with the seq)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            """SELECT run_id, array_agg((state->>'i')::bigint ORDER BY seq) AS sent
               FROM checkpoints WHERE tenant_id = $1 GROUP BY run_id""",
            tenant,
        )
    finally:
        await conn.close()
    total = sum(len(r["sent"]) for r in rows)
    ordered = all(list(r["sent"]) == sorted(set(r["sent"])) for r in rows)
    return total, ordered


async def one(env: Env, flood: bool, quota: float) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    base = f"bench-tenants-{tag}"
    tenant_a, tenant_b = f"a{tag}", f"b{tag}"
    s = env.settings_for(
        base, tenant_topics=True, tenant_rate=max(0, quota), group_prefix=f"tenants-{tag}"
    )
    names = s.topic_names
    topic_a, topic_b = names.lifecycle_for(tenant_a), names.lifecycle_for(tenant_b)
    unread = quota < 0  # A's flood on a topic the checkpointer does not read
    if unread:
        topic_a = f"unread-{tag}"
    await ensure_topics(env.services.kafka_bootstrap, [topic_a, topic_b], partitions=PARTITIONS)
    length = seconds(env)
    total_a, total_b = int(FLOOD * QUOTA * length) if flood else 0, int(B_RATE * length)
    timed: list[tuple[float, float]] = []  # B's (sent, latency)
    applied_a = 0

    def on_done(record: Any, now: float) -> None:
        nonlocal applied_a
        if record.topic == topic_b:
            sent = sent_at(record)
            timed.append((sent, now - sent))
        elif record.topic == topic_a:
            applied_a += 1

    bootstrap = env.services.kafka_bootstrap
    machine = MachineMeter()
    async with checkpoint_worker(s, env.services, on_done), loop_lag() as lag:
        loads = [start_load(bootstrap, topic_b, B_RATE, length, SIZE, tenant_b)]
        if flood:
            loads.append(start_load(bootstrap, topic_a, FLOOD * QUOTA, length, SIZE, tenant_a))
        started = time.monotonic()
        machine.start()
        deadline = started + length + 60
        while len(timed) < total_b and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        during = applied_a / max(1e-9, time.monotonic() - started)
        share = machine.stop()
        lags = lag.since(started + WARMUP_S)
        for proc in loads:
            await asyncio.to_thread(proc.join, 30)
        drained = True
        if flood and not unread:  # lifted as `alma tenants set A --rate 0` does
            pool = await asyncpg.create_pool(env.services.postgres_dsn, min_size=1, max_size=1)
            try:
                await tenant_settings.store(pool, tenant_a, rate_per_s=0, burst=None)
            finally:
                await pool.close()
            deadline = time.monotonic() + 120
            while applied_a < total_a and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            got, ordered = await in_order(env.services.postgres_dsn, tenant_a)
            drained = got == total_a and ordered
    if len(timed) < total_b:
        raise RuntimeError(
            f"tenant B: {len(timed)} of {total_b} events checkpointed within "
            f"{length + 60:.0f} s; the checkpointer fell behind. Run the benchmark again "
            "on an idle machine"
        )
    first = min(sent for sent, _ in timed)
    latencies = [latency for sent, latency in timed if sent >= first + WARMUP_S]
    return {
        "latencies_ms": [latency * 1000 for latency in latencies],
        "loop_lags_ms": lags,
        "busy": share.busy,
        "steal": share.steal,
        "a_rate": during,
        "a_total": total_a,
        "drained": drained,
    }


async def run(env: Env, section: Section) -> None:
    section.table(
        "tenants",
        f"Fairness: tenant B at {B_RATE} events/s, publish → durable and cached, while "
        f"tenant A floods at {FLOOD}× its {QUOTA} events/s quota (one checkpointer)",
        [
            "load",
            "B p50 ms",
            "B p99 ms",
            "B p99 × alone",
            "checkpointer's loop late, p99 ms",
            "its longest stall, ms",
            "machine busy %",
            "machine steal %",
            "A applied during the flood (/s)",
            "A: all applied, in order",
        ],
    )
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in MODES}
    for rep in range(env.reps):
        # each repetition one step further round: what a flood leaves behind (the
        # broker's log, PostgreSQL's dirty pages) falls on a different load each time
        for name, flood, quota in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
            env.step(f"tenants: {name}")
            results[name].append(await one(env, flood, quota))
            env.done()

    def pooled(name: str, p: float) -> Pooled:
        return Pooled.of([r["latencies_ms"] for r in results[name]], p, 1)

    alone = pooled("B alone", 99)

    def times_alone(name: str) -> Pooled:
        """The pooled p99 over the pooled p99 alone; each repetition's own ratio beside."""
        p99 = pooled(name, 99)
        runs = [x / y for x, y in zip(p99.runs, alone.runs, strict=True) if y]
        return Pooled(runs, 2, p99.value / alone.value)

    for name, flood, quota in MODES:
        got = results[name]
        read = flood and quota >= 0
        section.add(
            "tenants",
            [
                name,
                pooled(name, 50),
                pooled(name, 99),
                times_alone(name),
                Pooled.of([r["loop_lags_ms"] for r in got], 99, 1),
                Stat([max(r["loop_lags_ms"], default=0.0) for r in got], 0),
                Stat([r["busy"] * 100 for r in got], 0),
                Stat([r["steal"] * 100 for r in got], 1),
                Stat([r["a_rate"] for r in got], 0) if read else "",
                ("yes" if all(r["drained"] for r in got) else "NO") if read else "",
            ],
        )
    length = seconds(env)
    samples = sum(len(r["latencies_ms"]) for r in results["B alone"])
    share, bare, quota = (times_alone(name).value for name, _, _ in MODES[1:])
    held = MODES[3][0]
    rise = pooled(held, 99).value - alone.value
    section.note(
        "tenants",
        f"{length:g} s of load (B's latency from its second second on); 1 KB states over "
        "200 runs per tenant; each tenant its own "
        f"lifecycle topic of {PARTITIONS} partitions (ALMA_TENANT_TOPICS). B's percentiles "
        f"are of every repetition's samples pooled ({samples:,} of B alone), each "
        "repetition's own in parentheses: one run's p99 is its few slowest samples, and "
        "those of two runs of the same load differ by more than the flood does; each "
        "repetition takes the loads in turn from one further on, so that what a flood "
        "leaves behind does not always fall on the same load. With the "
        "quota (ALMA_TENANT_RATE), A's events beyond it are held back in order and its "
        "partitions paused until its bucket refills: B's never wait behind them. After the "
        "flood A's quota is lifted through the tenant settings table, without a restart, "
        f"and its backlog drains; every run of A is then read back ({FLOOD * QUOTA * length:,.0f} "
        f"events). From this run: with A's quota B's p99 is {quota:.2f}× alone (target "
        f"1.5×: {verdict(quota, results[held], rise, share)}), against {bare:.2f}× without "
        f"a quota; the flood's own cost on these cores, read by nobody, is {share:.2f}×. "
        "Beside each load, what held the checkpointer back while B was timed: how late "
        "its event loop woke when it asked to every 10 ms, at the 99th percentile and at "
        "its longest (a stall a few times in 30 s is not in the p99 of 3,000 wake-ups, "
        "yet can be all of B's tail), and the machine's busy and steal shares (steal: "
        "time the hypervisor gave other guests). A B tail that rises on a machine near "
        "100 % busy, or stolen from, is the machine's; one that rises as long as the "
        "checkpointer's loop stands is ALMA's; one that rises by more, with the machine "
        "half idle, is spent outside the checkpointer: in the broker or the producers.",
    )


def verdict(ratio: float, held: list[dict[str, Any]], rise_ms: float, unread: float) -> str:
    """Whether B's p99 with A held to its quota met the target and, where it did not,
    where B's tail was likelier spent: the machine (busy, or stolen from), the
    checkpointer's own loop (it stood for as long as B's p99 rose: ``rise_ms``), or
    outside it (the broker's answers, the producers': ``unread`` is B's p99 ratio with
    A's flood read by nobody)."""
    if ratio <= 1.5:
        return "met"
    busy = max(r["busy"] for r in held)
    steal = max(r["steal"] for r in held)
    if busy >= 0.9 or steal >= 0.05:
        return (
            f"not met, on a machine {busy:.0%} busy and {steal:.0%} stolen at the most: "
            "run it again on a quiet machine before reading it as ALMA's"
        )
    stall = max(max(r["loop_lags_ms"], default=0.0) for r in held)
    if stall >= rise_ms / 2:
        where = f"in the checkpointer's own loop, which stood up to {stall:.0f} ms"
    else:
        where = (
            f"outside the checkpointer's loop, which stood {stall:.0f} ms at the longest "
            f"where B's p99 rose {rise_ms:.0f} ms: in the broker's answers or the "
            f"producers' (A's flood read by nobody: {unread:.2f}× alone)"
        )
    return f"not met, with the machine {busy:.0%} busy at the most; {where}"
