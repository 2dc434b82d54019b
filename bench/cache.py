"""The checkpoint cache on one Redis and on a 3-node Redis Cluster (the same
redis-server binary, started here): what the checkpointer's writes and a resume's
reads cost on each.

* Writes: batches of 150 entries (50 runs × a head, a branch head and ``latest``,
  5 KB states each), one script per partition of the batch (12 partitions); entries
  per second and each batch's p50/p99.
* Reads: ``get`` of a run's latest checkpoint and ``heads`` (every head, what
  ``resume`` takes), p50/p99 over 1,000 reads each.

Everything shares the 2 cores: the nodes of the cluster, the single Redis, the
benchmark.
"""

from __future__ import annotations

import time
import uuid

from alma_core.cli.embedded import RedisClusterStack
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.cache_entries import CacheEntry
from bench.env import Env, scratch
from bench.report import Section, Stat, pct

STEPS_PER_REP = 2
PARTITIONS = 12
RUNS_PER_BATCH = 50


def _entries(batch: int, state: str) -> list[CacheEntry]:
    out = []
    for r in range(RUNS_PER_BATCH):
        run = f"run-{batch % 20}-{r}"
        doc = {"run_id": run, "tenant_id": "bench", "seq": batch + 1, "state": {"s": state}}
        for field in ("@", "b:x", "latest"):
            out.append(CacheEntry("bench", run, field, batch + 1, doc))
    return out


async def _measure(url: str, cluster: bool, batches: int, reads: int) -> dict[str, list[float]]:
    state = "x" * 5000
    async with RedisCheckpointCache.connect(
        url, prefix=f"b{uuid.uuid4().hex[:8]}", cluster=cluster, partitions=PARTITIONS, timeout_s=5
    ) as cache:
        writes: list[float] = []
        started = time.perf_counter()
        for b in range(batches):
            t = time.perf_counter()
            await cache.put(_entries(b, state), complete=True)
            writes.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - started
        gets, heads = [], []
        for i in range(reads):
            run = f"run-{i % 20}-{i % RUNS_PER_BATCH}"
            t = time.perf_counter()
            await cache.get("bench", run, "latest")
            gets.append(time.perf_counter() - t)
            t = time.perf_counter()
            await cache.heads("bench", run)
            heads.append(time.perf_counter() - t)
    rate = batches * RUNS_PER_BATCH * 3 / elapsed
    return {"rate": [rate], "writes": writes, "gets": gets, "heads": heads}


async def run(env: Env, section: Section) -> None:
    batches, reads = (100, 500) if env.quick else (400, 1000)
    got: dict[str, list[dict[str, list[float]]]] = {"one Redis": [], "Redis Cluster, 3 nodes": []}
    with scratch("alma-bench-cluster-") as root:
        cluster = RedisClusterStack(root)
        await cluster.start()
        try:
            for _ in range(env.reps):
                env.step("cache: one Redis")
                got["one Redis"].append(
                    await _measure(env.services.redis_url, False, batches, reads)
                )
                env.done()
                env.step("cache: Redis Cluster")
                got["Redis Cluster, 3 nodes"].append(
                    await _measure(cluster.url, True, batches, reads)
                )
                env.done()
        finally:
            await cluster.stop()
    section.table(
        "cache",
        "The checkpoint cache on one Redis and on a 3-node Redis Cluster",
        [
            "topology",
            "entries written/s",
            "write batch p50 ms",
            "p99 ms",
            "get latest p50 ms",
            "p99 ms",
            "heads p50 ms",
            "p99 ms",
        ],
    )
    for name, reps in got.items():

        def ms(key: str, p: float, reps: list[dict[str, list[float]]] = reps) -> str:
            return f"{pct([v for r in reps for v in r[key]], p) * 1000:.2f}"

        section.add(
            "cache",
            [
                name,
                Stat([r["rate"][0] for r in reps], 0),
                ms("writes", 50),
                ms("writes", 99),
                ms("gets", 50),
                ms("gets", 99),
                ms("heads", 50),
                ms("heads", 99),
            ],
        )
    section.note(
        "cache",
        f"{batches} batches of {RUNS_PER_BATCH * 3} entries (5 KB states) over {PARTITIONS} "
        f"partitions, then {reads} reads of each kind; the cluster's nodes, the single Redis "
        "and the benchmark share 2 cores.",
    )
