"""What ALMA Stream keeps on disk per event, what a day at 1,000 events/s costs with and
without retention, and how fast retention prunes.

The workload: runs of 9 events (4 nodes, each ``node.started`` and a ``node.completed``
with a 1 KB state, then ``workflow.completed``), written by the checkpointer's own
store (what the pipeline writes, without the broker) into a database of their own on
the bench's PostgreSQL, in batches of 250 events. Sizes are ``pg_total_relation_size``
(heap, indexes, TOAST) after ``VACUUM ANALYZE``, over the events written.

* A day at 1,000 ev/s (86.4M events) per table group; kept after a year without
  retention (365 days of it), and with the default lifetimes (the steady state: 30 days
  of checkpoints and event log, 90 of run rows, every run closed).
* Pruning every run past its lifetime with the default policy (one pruner, batches of
  200 runs): events pruned per second, against the 1,000/s written.
* The checkpointer's batch time while a pruner runs beside it, against without.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg

from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerRegistry
from alma_core.schemas.decoder import decode
from alma_core.settings import RetentionPolicy
from alma_core.storage import postgres, retention
from alma_core.storage.batches import Incoming
from alma_core.storage.checkpoints import PostgresCheckpointStore, StoreConfig
from bench.env import Env
from bench.report import Section, Stat, pct

STEPS_PER_REP = 3
EVENTS_PER_RUN = 9
RATE = 1_000  # events per second
DAY = 86_400
DEFAULTS = RetentionPolicy(
    checkpoints_days=30,
    events_days=30,
    runs_days=90,
    dead_letters_days=30,
    outcome_memories_days=180,
)
GROUPS = {  # what each row of the table sums
    "checkpoints and branch heads": ("checkpoints", "run_heads"),
    "event log (audit, inbox)": ("run_events",),
    "run rows": ("runs",),
}
KEPT_DAYS = {  # days of traffic each group holds in the steady state of the defaults
    "checkpoints and branch heads": DEFAULTS.checkpoints_days,
    "event log (audit, inbox)": DEFAULTS.events_days,
    "run rows": DEFAULTS.runs_days,
}
BATCH = 250


def run_docs(run: str, state_bytes: int = 1024) -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat()
    base = {"emitted_at": now, "tenant_id": "bench", "workflow_id": "wf", "run_id": run}
    docs: list[dict[str, Any]] = []
    for n in range(4):
        node = f"n{n}"
        docs.append({**base, "type": "node.started", "node_id": node, "payload": {}})
        state = {"step": n, "notes": "x" * state_bytes}
        docs.append(
            {**base, "type": "node.completed", "node_id": node, "payload": {"state": state}}
        )
    docs.append(
        {
            **base,
            "type": "workflow.completed",
            "payload": {
                "outcome": "success",
                "duration_ms": 100,
                "node_count": 4,
                "nodes_succeeded": 4,
                "nodes_failed": 0,
                "task": "file the quarterly invoices",
            },
        }
    )
    return [{**d, "event_id": uuid.uuid4().hex} for d in docs]


class Writer:
    """The checkpointer's store on partition 0 of a topic of its own."""

    def __init__(self, pool: asyncpg.Pool, name: str) -> None:
        self.store = PostgresCheckpointStore(
            pool, StoreConfig(name, name, "x", "y", 10**9), ReducerRegistry()
        )
        self.offset = 0
        self.name = name

    async def write(self, runs: int) -> list[float]:
        """Write ``runs`` runs; the time of each batch."""
        records = []
        for r in range(runs):
            for doc in run_docs(f"{self.name}-{self.offset}-{r}"):
                raw = json.dumps(doc).encode()
                key = doc["run_id"].encode()
                records.append(Incoming(self.name, 0, self.offset, key, raw, decode(raw)))
                self.offset += 1
        times = []
        for lo in range(0, len(records), BATCH):
            started = time.perf_counter()
            await self.store.transact(
                f"c-{self.name}", {(self.name, 0): records[lo : lo + BATCH]}, TenantLimits()
            )
            times.append(time.perf_counter() - started)
        return times


async def sizes(conn: asyncpg.Connection) -> dict[str, int]:
    await conn.execute("VACUUM ANALYZE")
    tables = [t for group in GROUPS.values() for t in group]
    rows = await conn.fetch(
        "SELECT relname, pg_total_relation_size(oid) AS bytes FROM pg_class "
        "WHERE relname = ANY($1::text[]) AND relkind = 'r'",
        tables,
    )
    return {r["relname"]: r["bytes"] for r in rows}


async def one(env: Env, runs: int) -> dict[str, Any]:
    """A fresh database: write, measure, age every run, prune beside a writer."""
    async with env.database("retention") as dsn:
        conn = await asyncpg.connect(dsn)
        pool = await postgres.create_pool(dsn, min_size=2, max_size=4)
        try:
            empty = await sizes(conn)
            env.step(f"retention: writing {runs * EVENTS_PER_RUN:,} events")
            await Writer(pool, "w").write(runs)
            written = await sizes(conn)
            env.done()
            per_event = {
                group: sum(written[t] - empty[t] for t in tables) / (runs * EVENTS_PER_RUN)
                for group, tables in GROUPS.items()
            }
            baseline = Writer(pool, "u")
            alone = await baseline.write(max(runs // 4, 10))  # the same table sizes, no pruner
            await conn.execute(
                "UPDATE runs SET completed_at = now() - interval '100 days' WHERE run_id LIKE 'w-%'"
            )
            env.step("retention: pruning beside a writer")
            beside = Writer(pool, "v")
            started = time.perf_counter()
            pruning = asyncio.create_task(retention.prune(pool, DEFAULTS, max_batches=10**6))
            during: list[float] = []
            for _ in range(runs):  # batches for as long as the pruner runs (bounded)
                if pruning.done():
                    break
                during += await beside.write(BATCH // EVENTS_PER_RUN)
            result = await pruning
            prune_s = time.perf_counter() - started
            env.done()
            env.step("retention: after the prune")
            after = await sizes(conn)
            left = await conn.fetchval("SELECT count(*) FROM run_events WHERE run_id LIKE 'w-%'")
            env.done()
        finally:
            await pool.close()
            await conn.close()
    return {
        "per_event": per_event,
        "events_pruned_per_s": result.events / prune_s,
        "rows_pruned": sum(result.rows().values()),
        "prune_s": prune_s,
        "runs_deleted": result.runs_deleted,
        "left": left,
        "alone": alone,
        "during": during,
        "after": sum(after.values()) - sum(empty.values()),
        "written": sum(written.values()) - sum(empty.values()),
    }


def gb(value: float) -> str:
    return f"{value / 1e9:,.1f} GB" if value < 1e12 else f"{value / 1e12:,.2f} TB"


async def run(env: Env, section: Section) -> None:
    runs = 2_000 if env.quick else 6_000
    got = [await one(env, runs) for _ in range(env.reps)]
    section.table(
        "retention_disk",
        f"Disk per event and for a day at {RATE:,} events/s (runs of {EVENTS_PER_RUN} events, "
        "1 KB states)",
        [
            "table group",
            "bytes per event",
            "one day",
            "after a year, no retention",
            "steady state, default retention",
        ],
    )
    day = RATE * DAY
    total = [0.0, 0.0, 0.0, 0.0]
    for group in GROUPS:
        per = Stat([g["per_event"][group] for g in got], 0)
        kept = KEPT_DAYS[group]
        cells = [per.median * day, per.median * day * 365, per.median * day * kept]
        total = [total[0] + per.median, *(t + c for t, c in zip(total[1:], cells, strict=True))]
        section.add(
            "retention_disk",
            [group, per, gb(cells[0]), gb(cells[1]), f"{gb(cells[2])} ({kept:g} days)"],
        )
    section.add(
        "retention_disk",
        ["**all**", f"{total[0]:,.0f}", gb(total[1]), gb(total[2]), gb(total[3])],
    )
    section.note(
        "retention_disk",
        f"Measured over {runs * EVENTS_PER_RUN:,} events per repetition; the day, year and "
        "steady-state columns multiply the median. Outcomes and memories (the learner's) are "
        "not in it: they grow with finished runs, not events, and node outcomes age out after "
        f"{DEFAULTS.outcome_memories_days:g} days.",
    )
    section.table(
        "retention_prune",
        "Pruning with the default policy, every run past its lifetime, a writer beside it",
        [
            "events pruned per s",
            f"× the {RATE:,} ev/s written",
            "rows deleted",
            "writer batch p50 ms alone",
            "p50 ms beside the pruner",
            "p99 ms alone",
            "p99 ms beside",
        ],
    )
    rate = Stat([g["events_pruned_per_s"] for g in got], 0)
    alone = [t * 1000 for g in got for t in g["alone"]]
    during = [t * 1000 for g in got for t in g["during"]]
    section.add(
        "retention_prune",
        [
            rate,
            f"{rate.median / RATE:.1f}×",
            f"{got[0]['rows_pruned']:,}",
            f"{pct(alone, 50):.1f}",
            f"{pct(during, 50):.1f}",
            f"{pct(alone, 99):.1f}",
            f"{pct(during, 99):.1f}",
        ],
    )
    section.note(
        "retention_prune",
        f"A batch is {BATCH} events; the writer alone writes into tables of the same size "
        f"just before. Every step ran (checkpoints, event log, run rows); "
        f"{got[0]['left']} events of the pruned runs were left. PostgreSQL keeps the freed "
        "pages for new rows (after VACUUM): the files do not shrink, they stop growing.",
    )
