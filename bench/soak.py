"""The embedded stack for a long while: a steady load from an independent Kafka client
through `alma up`, measured window by window.

`alma up` runs as a user runs it (a process of its own, every service embedded, in a
scratch directory); a producer of another client library (confluent-kafka, in a thread)
sends ``RATE`` ``node.completed`` events a second, each with a ``STATE_BYTES`` state,
over ``RUNS`` runs, for the soak's length (30 minutes; 5 with ``--quick``). Per window
(5 minutes; 1 with ``--quick``):

* events applied per second, and the latency from each event's ``emitted_at`` to its
  checkpoint (p50, p95, p99), read from PostgreSQL;
* memory: the broker, PostgreSQL (with its backends) and Redis as `alma up` reports
  them (``alma_embedded_memory_bytes``), and the `alma up` process itself, which runs
  every worker (``process_resident_memory_bytes``), at the window's end;
* PostgreSQL's bytes per event applied in the window, and the records the broker keeps
  in its longest partition.

At the end the producer stops, every event is waited for (each one applied exactly once
is the first check), and the verdicts are noted: the last window's p50 against the
first's, and each memory figure's growth over the second half.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench.env import Env, scratch
from bench.report import Section

RATE = 300  # events per second
STATE_BYTES = 2048
RUNS = 600
TENANT = "soak"
MEMORY = ("broker", "workers", "redis", "postgres")


@dataclass(frozen=True)
class Length:
    """How long the soak runs and how it is cut into windows (seconds; 0: the default
    of the mode), and the ``ALMA_*`` settings `alma up` runs with (a lever measured)."""

    total_s: float
    window_s: float
    settings: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls, quick: bool, total_s: float = 0, window_s: float = 0, settings: Sequence[str] = ()
    ) -> Length:
        total = total_s or (300 if quick else 1800)
        pairs = dict(item.split("=", 1) for item in settings)
        return cls(total, min(window_s or (60 if quick else 300), total), pairs)

    @property
    def windows(self) -> int:
        return max(1, round(self.total_s / self.window_s))

    @property
    def steps(self) -> int:
        return self.windows + 2


@dataclass
class Producer:
    """The independent client: confluent-kafka in a thread, at a steady rate."""

    bootstrap: str
    topic: str
    rate: int = RATE
    sent: int = 0
    failed: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from confluent_kafka import Producer as Kafka

        kafka = Kafka({"bootstrap.servers": self.bootstrap, "linger.ms": 5, "acks": "all"})

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                self.failed += 1

        tick, due = 0.01, time.monotonic()
        owed = 0.0
        while not self.stop.is_set():
            owed += self.rate * tick
            while owed >= 1:
                owed -= 1
                run = f"soak-{self.sent % RUNS}"
                doc = {
                    "event_id": uuid.uuid4().hex,
                    "type": "node.completed",
                    "emitted_at": datetime.now(UTC).isoformat(),
                    "tenant_id": TENANT,
                    "workflow_id": "soak",
                    "run_id": run,
                    "node_id": f"n{self.sent}",
                    # hex text: compresses about as well as an agent's notes (~2x)
                    "payload": {
                        "state": {"step": self.sent, "notes": os.urandom(STATE_BYTES // 2).hex()}
                    },
                }
                kafka.produce(
                    self.topic, json.dumps(doc).encode(), run.encode(), on_delivery=delivered
                )
                self.sent += 1
            kafka.poll(0)
            due += tick
            time.sleep(max(0.0, due - time.monotonic()))
        kafka.flush(30)


@contextlib.asynccontextmanager
async def alma_up(root: Path, settings: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
    """`alma up` in ``root`` (every service embedded; ``settings``: ``ALMA_*`` variables
    for it), its endpoints once it is up (and its process id, ``pid``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALMA_")}
    env |= {"ALMA_DATA_DIR": str(root / ".alma"), "ALMA_METRICS_PORT": "0", "COLUMNS": "200"}
    env |= {"ALMA_EMBEDDED_BROKER": "tansu"}  # not `auto`: the broker measured is chosen
    env |= settings
    endpoints = root / ".alma" / "endpoints.json"
    with (root / "up.log").open("ab") as log:
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; watched below
            [sys.executable, "-m", "alma_core.cli", "up"],
            env=env,
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while "metrics_url" not in (endpoints.read_text() if endpoints.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"alma up did not come up; its output: {root / 'up.log'}")
            await asyncio.sleep(0.5)
        yield {**json.loads(endpoints.read_text()), "pid": proc.pid}
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 60)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def memory(sample: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """MB held by each service, and by the `alma up` process (the workers)."""
    out = {
        dict(labels)["service"]: value / 2**20
        for (name, labels), value in sample.items()
        if name == "alma_embedded_memory_bytes"
    }
    out["workers"] = sample.get(("process_resident_memory_bytes", ()), 0.0) / 2**20
    return out


def longest(sample: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> int:
    return int(
        max((v for (n, _), v in sample.items() if n == "alma_embedded_log_records"), default=0)
    )


async def window_figures(
    conn: asyncpg.Connection, start: datetime, end: datetime
) -> tuple[int, list[float]]:
    """Events applied in [start, end) and their latency percentiles (ms)."""
    row = await conn.fetchrow(
        """SELECT count(*) AS n,
                  percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
                      ORDER BY extract(epoch FROM c.created_at - e.emitted_at)) AS q
           FROM checkpoints c
           JOIN run_events e ON e.tenant_id = c.tenant_id AND e.event_id = c.event_id
           WHERE c.tenant_id = $1 AND c.created_at >= $2 AND c.created_at < $3""",
        TENANT,
        start,
        end,
    )
    assert row is not None
    return int(row["n"]), [1000 * q for q in (row["q"] or [float("nan")] * 3)]


async def run(env: Env, section: Section, length: Length) -> None:
    key = "soak"
    given = ", ".join(f"{k}={v}" for k, v in length.settings.items()) or "its defaults"
    section.table(
        key,
        f"The embedded stack under a steady load ({RATE} events/s of {STATE_BYTES // 1024} KB "
        f"from confluent-kafka through `alma up` with {given}, {length.total_s / 60:g} minutes)",
        [
            "window (min)",
            "events/s",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            *(f"{name} MB" for name in MEMORY),
            "PostgreSQL bytes/event",
            "longest partition (records)",
        ],
    )
    with scratch("alma-soak-") as root:
        env.step("soak: starting alma up")
        chosen = {"ALMA_EMBEDDED_BROKER": env.broker_kind, **length.settings}
        async with alma_up(root, chosen) as up:
            env.done()
            conn = await asyncpg.connect(up["postgres_dsn"])
            try:
                await soak(env, section, key, length, up, conn)
            finally:
                await conn.close()
    env.done()


async def soak(
    env: Env,
    section: Section,
    key: str,
    length: Length,
    up: dict[str, Any],
    conn: asyncpg.Connection,
) -> None:
    producer = Producer(up["kafka_bootstrap"], "alma.lifecycle.v1")
    thread = threading.Thread(target=producer.run, name="soak-producer", daemon=True)
    thread.start()
    rows: list[list[Any]] = []
    size_before = int(await conn.fetchval("SELECT pg_database_size(current_database())"))
    applied_before = 0
    start: datetime = await conn.fetchval("SELECT now()")
    try:
        for w in range(length.windows):
            env.step(f"soak: window {w + 1} of {length.windows}")
            await asyncio.sleep(length.window_s)
            end: datetime = await conn.fetchval("SELECT now()")
            n, (p50, p95, p99) = await window_figures(conn, start, end)
            sample = scrape(up["metrics_url"])
            held = memory(sample)
            size = int(await conn.fetchval("SELECT pg_database_size(current_database())"))
            applied = applied_before + n
            per_event = (size - size_before) / n if n else float("nan")
            rows.append(
                [
                    f"{(w + 1) * length.window_s / 60:g}",
                    f"{n / (end - start).total_seconds():,.0f}",
                    f"{p50:,.1f}",
                    f"{p95:,.1f}",
                    f"{p99:,.1f}",
                    *(f"{held.get(name, float('nan')):,.0f}" for name in MEMORY),
                    f"{per_event:,.0f}",
                    f"{longest(sample):,}",
                ]
            )
            section.add(key, rows[-1])
            size_before, applied_before, start = size, applied, end
            env.done()
    finally:
        producer.stop.set()
        await asyncio.to_thread(thread.join, 60)
    env.step("soak: every event applied?")
    deadline = time.monotonic() + 600
    total = 0
    while time.monotonic() < deadline:
        total = int(
            await conn.fetchval("SELECT count(*) FROM checkpoints WHERE tenant_id = $1", TENANT)
        )
        if total >= producer.sent - producer.failed:
            break
        await asyncio.sleep(1)
    distinct = int(
        await conn.fetchval(
            "SELECT count(DISTINCT event_id) FROM checkpoints WHERE tenant_id = $1", TENANT
        )
    )
    section.note(
        key,
        f"Events sent {producer.sent:,} (refused by the broker: {producer.failed}); "
        f"checkpoints {total:,}, of distinct events {distinct:,}: "
        + (
            "every event applied exactly once."
            if total == distinct == producer.sent - producer.failed
            else "NOT every event applied exactly once."
        ),
    )
    section.note(key, verdict(rows))


def verdict(rows: list[list[Any]]) -> str:
    """The last window's p50 against the first's; each memory figure over the second half."""

    def num(cell: Any) -> float:
        return float(str(cell).replace(",", ""))

    if len(rows) < 2:
        return "One window only: no trend."
    first, last = num(rows[0][2]), num(rows[-1][2])
    half = rows[len(rows) // 2 - 1 if len(rows) > 2 else 0]
    growth = []
    for i, name in enumerate(MEMORY, start=5):
        a, b = num(half[i]), num(rows[-1][i])
        growth.append(f"{name} {a:,.0f} → {b:,.0f} MB ({(b - a) / a * 100 if a else 0:+.0f} %)")
    return (
        f"p50, last window against the first: {last:,.1f} / {first:,.1f} ms = "
        f"{last / first if first else float('nan'):.2f}×. Memory over the second half: "
        + "; ".join(growth)
        + "."
    )
