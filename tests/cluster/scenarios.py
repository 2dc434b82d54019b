"""The fault scenarios: each runs the orchestrator host publishing to two worker hosts
through the three-broker cluster, injects its fault while events flow, heals it, waits
for the backlog to drain and hands everything to the checker
(:mod:`tests.cluster.checker`).

The pause is measured from PostgreSQL, not from the workers: a watcher polls the
number of checkpoints every 50 ms; ``stalled_s`` is the longest time without a new one
from the fault's start to the end of the run (the orchestrator publishes steadily, so
in a healthy cluster it stays near the publishing period), and ``flowing_after_s`` is
how long after the fault healed (the broker, the link or the worker back) the next
checkpoint came.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from alma_core.settings import Settings
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from tests.cluster.checker import Verdict, acknowledged, check
from tests.cluster.cluster import WORKER_HOSTS, Cluster
from tests.cluster.orchestrator import TENANT
from tests.cluster.postgres_ha import PatroniNode

PUBLISH_LIMIT_S = 600  # the orchestrator is stopped (SIGTERM) well before
Inject = Callable[[Cluster, Settings, float], Awaitable["Fault"]]


@dataclass
class Fault:
    what: str  # the faults injected, in words
    started: float  # monotonic
    healed: float  # monotonic: when the last fault was undone
    served_newer: int = 0
    rolled_back: int = 0
    cache_ahead: int = 0  # runs whose cache entry was newer than PostgreSQL's latest
    readiness: tuple[int, int] | None = None  # a worker's /readyz during the fault, after


@dataclass
class Outcome:
    scenario: str
    fault: str
    verdict: Verdict
    stalled_s: float
    flowing_after_s: float | None
    retries: int
    rolled_back: int = 0  # checkpoints a failover lost, applied again from Kafka
    served_newer: int = 0  # reads that returned a state PostgreSQL did not have
    cache_ahead: int = 0  # runs whose cache was newer than PostgreSQL when they were read
    readiness: tuple[int, int] | None = None  # the cut-off worker's /readyz during, after


class Watcher:
    """Checkpoints counted every 50 ms: when each new one was first seen."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.seen: list[tuple[float, int]] = []
        self.peak = 0
        self.rolled_back = 0  # the most checkpoints seen to vanish (a failover's loss)
        self.task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        conn: asyncpg.Connection | None = None
        last = -1
        try:
            while True:
                try:
                    if conn is None:
                        conn = await asyncpg.connect(self.dsn, timeout=2)
                    n = int(await conn.fetchval("SELECT count(*) FROM checkpoints", timeout=2))
                    if n > last:
                        self.seen.append((time.monotonic(), n))
                    elif n < last:  # a failover lost committed checkpoints
                        self.rolled_back = max(self.rolled_back, self.peak - n)
                        self.seen.append((time.monotonic(), n))
                    self.peak, last = max(self.peak, n), n
                except Exception:  # noqa: BLE001 - a failover: connect again, keep counting
                    if conn is not None:
                        conn.terminate()
                    conn = None
                await asyncio.sleep(0.05)
        finally:
            if conn is not None:
                conn.terminate()

    async def __aenter__(self) -> Watcher:
        self.task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.wait([self.task])

    def stalled(self, since: float) -> float:
        times = [t for t, _ in self.seen if t >= since]
        if not times:
            return float("inf")
        edges = [since, *times]
        return max(b - a for a, b in itertools.pairwise(edges))

    def first_after(self, moment: float) -> float | None:
        later = [t for t, _ in self.seen if t >= moment]
        return later[0] - moment if later else None


async def _hold(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def leader_killed(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """SIGKILL the broker leading most of the lifecycle topic's partitions; restart it."""
    leaders = await cluster.leaders(settings.lifecycle_topic)
    victim = max(set(leaders.values()), key=list(leaders.values()).count)
    started = time.monotonic()
    cluster.brokers[victim].kill()
    await _hold(hold_s)
    await cluster.brokers[victim].restart()
    return Fault(
        f"SIGKILL broker {victim} (leader of {list(leaders.values()).count(victim)} "
        f"of {len(leaders)} partitions), restarted {hold_s:.0f} s later",
        started,
        time.monotonic(),
    )


async def controller_killed(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """SIGKILL the active KRaft controller; restart it."""
    victim = cluster.active_controller()
    started = time.monotonic()
    cluster.brokers[victim].kill()
    await _hold(hold_s)
    await cluster.brokers[victim].restart()
    return Fault(
        f"SIGKILL the active controller (node {victim}), restarted {hold_s:.0f} s later",
        started,
        time.monotonic(),
    )


async def broker_cut_off(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """The leader of most partitions loses its network (to the other brokers and to
    every client) while producers write; then it is back."""
    leaders = await cluster.leaders(settings.lifecycle_topic)
    victim = max(set(leaders.values()), key=list(leaders.values()).count)
    host = cluster.brokers[victim].host
    started = time.monotonic()
    host.cut_off()
    await _hold(hold_s)
    host.reconnect()
    return Fault(f"broker {victim}'s host cut off for {hold_s:.0f} s", started, time.monotonic())


async def rolling_restart(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """Brokers stopped (SIGTERM) and started again in turn, waiting for the ISR to be
    whole between two, as a rolling upgrade does: ``hold_s`` of them (the long form all
    three; the short form one, the same step, ~25 s a broker)."""
    started = time.monotonic()
    chosen = list(cluster.brokers.values())[: max(1, int(hold_s))]
    for broker in chosen:
        await broker.stop(grace_s=30)
        await broker.restart()
        await cluster.wait_replicated(settings.lifecycle_topic)
    what = (
        f"each of the {len(chosen)} brokers stopped and restarted in turn"
        if len(chosen) == len(cluster.brokers)
        else f"{len(chosen)} of the {len(cluster.brokers)} brokers stopped and restarted"
    )
    return Fault(what, started, time.monotonic())


async def worker_cut_from_kafka(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """Worker host w1 loses the brokers but keeps PostgreSQL, past its group session."""
    w1 = cluster.host("w1")
    started = time.monotonic()
    w1.block(*(b.host.address for b in cluster.brokers.values()))
    await _hold(hold_s)
    during = await cluster.readiness("w1")  # what a load balancer sees of it now
    w1.unblock()
    healed = time.monotonic()
    after = await _ready_again(cluster, "w1")
    return Fault(
        f"worker host w1 cut off from the brokers (not PostgreSQL) for {hold_s:.0f} s; "
        f"its /readyz {during} then, {after} again {time.monotonic() - healed:.1f} s after",
        started,
        healed,
        readiness=(during, after),
    )


async def _ready_again(cluster: Cluster, host: str, limit_s: float = 60) -> int:
    deadline = time.monotonic() + limit_s
    status = await cluster.readiness(host)
    while status != 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        status = await cluster.readiness(host)
    return status


async def worker_frozen(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """Worker w1 frozen (SIGSTOP) past its group session, then thawed."""
    proc = cluster.workers[0].proc
    assert proc is not None
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGSTOP)
    await _hold(hold_s)
    os.kill(proc.pid, signal.SIGCONT)
    return Fault(
        f"worker w1 frozen (SIGSTOP) for {hold_s:.0f} s, then thawed", started, time.monotonic()
    )


async def worker_killed(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """Worker w1 SIGKILLed (its host lost, or an out-of-memory kill), started again
    ``hold_s`` later, as a process manager would: under the same name in its groups
    (ALMA_GROUP_INSTANCE_ID), so it takes its partitions back and the other worker is
    never held by a rebalance waiting for the dead member's session."""
    worker = cluster.workers[0]
    started = time.monotonic()
    worker.kill()
    await _hold(hold_s)
    worker.start()
    await worker.wait_started(90)
    return Fault(
        f"worker w1 SIGKILLed, started again {hold_s:.0f} s later under its name "
        f"(back after {time.monotonic() - started:.1f} s)",
        started,
        time.monotonic(),
    )


async def worker_cut_from_postgres(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """Worker host w1 loses PostgreSQL but keeps the brokers."""
    w1 = cluster.host("w1")
    started = time.monotonic()
    w1.block(*(n.host.address for n in cluster.postgres.nodes))
    await _hold(hold_s)
    w1.unblock()
    return Fault(
        f"worker host w1 cut off from PostgreSQL and Redis for {hold_s:.0f} s",
        started,
        time.monotonic(),
    )


async def orchestrator_cut_off(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """The orchestrator host loses the network mid-publish, then is back: its producer
    retries what it had in flight (idempotent: nothing doubled)."""
    o1 = cluster.host("o1")
    started = time.monotonic()
    o1.cut_off()
    await _hold(hold_s)
    o1.reconnect()
    return Fault(f"orchestrator host cut off for {hold_s:.0f} s", started, time.monotonic())


async def cache_cut_off(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """The Redis host loses the network (a cache that may be lost): the workers go on
    without it, each call given up after the cache's short timeout; when it is back it
    holds entries older than PostgreSQL, which no reader may be served."""
    cache = cluster.host("cache")
    started = time.monotonic()
    cache.cut_off()
    await _hold(hold_s)
    cache.reconnect()
    healed = time.monotonic()
    served, ahead = await reads_newer_than_postgres(settings)
    return Fault(
        f"the Redis host cut off for {hold_s:.0f} s", started, healed, served, cache_ahead=ahead
    )


async def reads_newer_than_postgres(settings: Settings) -> tuple[int, int]:
    """Each run read as the SDK reads it (the cache first), then PostgreSQL's latest:
    how many reads returned a checkpoint PostgreSQL does not have (a later seq, or
    another state at the same seq), and how many runs the cache held ahead of
    PostgreSQL at that moment (what such a read would have served)."""
    assert settings.postgres_dsn
    served = ahead = 0
    async with (
        connect(settings.postgres_dsn, max_size=2) as pool,
        RedisCheckpointCache.for_settings(settings) as cache,
    ):
        reader = CheckpointReader(pool, cache, tenant_id=TENANT)
        runs = [r["run_id"] for r in await pool.fetch("SELECT run_id FROM runs")]
        for run_id in runs:
            cached, _ = await cache.get(TENANT, run_id, "latest")
            got = await reader.latest(run_id)
            truth = await pool.fetchrow(
                "SELECT seq, state_hash FROM checkpoints WHERE run_id = $1 "
                "ORDER BY seq DESC LIMIT 1",
                run_id,
            )
            if got is None or truth is None:
                continue
            if cached is not None and cached["seq"] > truth["seq"]:
                ahead += 1
            if got.seq > truth["seq"] or (
                got.seq == truth["seq"] and got.state_hash != truth["state_hash"]
            ):
                served += 1
    return served, ahead


async def _primary_lost(cluster: Cluster, settings: Settings, hold_s: float, sync: bool) -> Fault:
    pg = cluster.postgres
    await pg.set_synchronous(sync)
    old = pg.primary()
    assert old is not None
    standby = next(n for n in pg.nodes if n is not old)
    started = time.monotonic()
    if not sync:
        # the standby falls behind (its replication cut) while the primary commits:
        # what an asynchronous failover loses, made certain rather than left to luck
        standby.host.block(old.host.address)
        await _hold(3)
    # the workers are kept from PostgreSQL from now until a reader has looked at the
    # promoted primary: what the cache holds then is what it held when the old one died
    workers = [cluster.host(name) for name in WORKER_HOSTS]
    for host in workers:
        host.block(*(n.host.address for n in pg.nodes))
    had = await _checkpoints(old, settings)
    old.die()
    standby.host.unblock()
    kept = await _checkpoints(standby, settings)  # a hot standby answers reads until promoted
    promoted = await pg.wait_promoted(old)
    served, ahead = await reads_newer_than_postgres(settings)
    for host in workers:
        host.unblock()
    await _hold(hold_s)
    await old.start()  # back: rewound, a standby of the new primary
    await pg.wait_roles()
    if sync:
        await pg.set_synchronous(False)
    mode = "synchronous" if sync else "asynchronous, the standby 3 s behind"
    return Fault(
        f"PostgreSQL primary {old.host.name} SIGKILLed ({mode}); {standby.host.name} "
        f"promoted after {promoted:.1f} s, the cache then ahead of it for {ahead} of the "
        f"runs; {old.host.name} back as its standby",
        started,
        time.monotonic(),
        served,
        max(0, had - kept),
        ahead,
    )


async def _checkpoints(node: PatroniNode, settings: Settings) -> int:
    """How many checkpoints the scenario's database holds on that node now."""
    host, port = node.url.split(":")
    database = (settings.postgres_dsn or "").rpartition("/")[2].partition("?")[0]
    conn = await asyncpg.connect(
        host=host, port=int(port), user="postgres", database=database, timeout=5
    )
    try:
        return int(await conn.fetchval("SELECT count(*) FROM checkpoints"))
    finally:
        await conn.close()


async def primary_lost_sync(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """The PostgreSQL primary's host dies under synchronous replication."""
    return await _primary_lost(cluster, settings, hold_s, sync=True)


async def primary_lost_async(cluster: Cluster, settings: Settings, hold_s: float) -> Fault:
    """The PostgreSQL primary's host dies under asynchronous replication, its standby
    behind: the transactions it had not received are lost with their offsets, so
    their events are read again from Kafka and applied again."""
    return await _primary_lost(cluster, settings, hold_s, sync=False)


# name -> (the fault, how long it holds in the short form and in the long form; for the
# rolling restart, how many brokers it restarts)
SCENARIOS: dict[str, tuple[Inject, float, float]] = {
    "kafka leader killed": (leader_killed, 6, 15),
    "kafka controller killed": (controller_killed, 6, 15),
    "kafka broker cut off": (broker_cut_off, 8, 20),
    "kafka rolling restart": (rolling_restart, 1, 3),
    "worker cut off from kafka": (worker_cut_from_kafka, 14, 25),
    "worker cut off from postgres": (worker_cut_from_postgres, 8, 20),
    "worker frozen": (worker_frozen, 14, 25),
    "worker killed": (worker_killed, 1, 3),
    "orchestrator cut off": (orchestrator_cut_off, 8, 20),
    "cache cut off": (cache_cut_off, 8, 20),
    "postgres primary lost, synchronous": (primary_lost_sync, 3, 15),
    "postgres primary lost, asynchronous": (primary_lost_async, 3, 15),
}


# Scenarios whose runs do not fan out and join. A failover that loses commits
# (asynchronous replication) cannot repair a merge whose reply the orchestrator already
# had: it went on, and its run's later events are applied again before the merge, which
# then finds the run moved past it (`run_moved_past_join`: an error reply and a dead
# letter for a join once answered ok). docs/guarantees.md, guarantee 10, says so.
NO_JOINS = frozenset({"postgres primary lost, asynchronous"})


async def run(
    cluster: Cluster,
    name: str,
    *,
    long: bool = False,
    runs: int = 8,
    joins: int = 2,
    rate: float = 40,
) -> Outcome:
    """One scenario, start to finish, on fresh topics and a fresh database."""
    inject, short_hold, long_hold = SCENARIOS[name]
    joins = 0 if name in NO_JOINS else joins
    settings = await cluster.fresh(name)
    assert settings.postgres_dsn
    acked_path = cluster.root / f"acked-{settings.group_prefix}.jsonl"
    await cluster.start_workers(settings)
    warmup, after = (3.0, 4.0) if not long else (10.0, 15.0)
    hold = long_hold if long else short_hold
    # publishing from before the fault until ``after`` seconds after it healed
    orchestrator = cluster.orchestrate(settings, acked_path, runs, PUBLISH_LIMIT_S, rate, joins)
    try:
        async with Watcher(settings.postgres_dsn) as watcher:
            await asyncio.sleep(warmup)
            fault = await inject(cluster, settings, hold)
            await asyncio.sleep(after)
            # and until the orchestrator published again, should it take longer (a host
            # back from a cut: a request in flight waits for TCP's next retransmission,
            # up to ~6 s after an 8 s cut), so that publishing after the heal is measured
            healed_at = time.time() - (time.monotonic() - fault.healed)  # epoch, as acked
            await _published_since(acked_path, healed_at, limit_s=30)
            orchestrator.send_signal(signal.SIGTERM)
            stop_by = time.monotonic() + 60
            while orchestrator.poll() is None and time.monotonic() < stop_by:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            assert orchestrator.returncode == 0, (
                f"the orchestrator failed ({orchestrator.returncode})"
            )
            total = len(acknowledged(acked_path))
            deadline = time.monotonic() + 90
            while (  # noqa: ASYNC110 - another process's progress, read from PostgreSQL
                watcher.seen[-1][1] if watcher.seen else 0
            ) < total and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            stalled = watcher.stalled(fault.started)
            flowing = watcher.first_after(fault.healed)
        # and until every reply and hand-off committed has been sent (one whose send
        # failed in the fault waits for the outbox's sweep, 10-15 s later)
        await _outbox_drained(settings.postgres_dsn, limit_s=60)
        cluster.stop_workers()
        verdict = await check(settings, acked_path, healed_at)
        retries = _retries(cluster.root / f"o1-{settings.group_prefix}.log")
        return Outcome(
            name,
            fault.what,
            verdict,
            stalled,
            flowing,
            retries,
            max(watcher.rolled_back, fault.rolled_back),
            fault.served_newer,
            fault.cache_ahead,
            fault.readiness,
        )
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
            orchestrator.wait()
        cluster.stop_workers()
        for host in cluster.network.hosts.values():  # every scenario starts whole
            with contextlib.suppress(Exception):
                host.reconnect()
        for broker in cluster.brokers.values():
            if broker.exit_status is not None or broker.proc is None:
                await broker.restart()


async def _outbox_drained(dsn: str, limit_s: float) -> None:
    """Until no outbox row waits to be published, or for ``limit_s`` at the most (the
    verdict then names a join without a reply)."""
    deadline = time.monotonic() + limit_s
    conn = await asyncpg.connect(dsn)
    try:
        while time.monotonic() < deadline:
            pending = await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            if pending == 0:
                return
            await asyncio.sleep(0.5)
    finally:
        await conn.close()


async def _published_since(acked_path: Path, since: float, limit_s: float) -> None:
    """Until an event acknowledged at ``since`` (epoch) or later is written down, or for
    ``limit_s`` at the most (the verdict then says no checkpoint followed the heal)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ValueError):  # a line being written: read again
            if any(a["at"] >= since for a in acknowledged(acked_path)):
                return
        await asyncio.sleep(0.2)


def _retries(log: Path) -> int:
    import json

    for line in reversed(log.read_text(errors="replace").splitlines()):
        with contextlib.suppress(ValueError):
            return int(json.loads(line)["retries"])
    return -1
