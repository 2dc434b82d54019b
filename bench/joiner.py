"""Joiner benchmark: merge cost alone (5 branch states of 5 KB and 50 KB), and join
request → reply latency through the SDK at fixed offered loads.

    python -m bench.joiner [--quick] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from rich.progress import Progress

from alma_core import settings as settings_mod
from alma_core.consumers.worker import Services, run_worker
from alma_core.schemas.events import NodeCompleted
from alma_core.sdk.client import AlmaClient
from alma_core.types import WorkflowContext
from bench import merges
from bench.env import stack
from bench.report import console, ms, report

REDUCERS = {"log": "append", "cost": "sum", "score": "max", "facts": "merge_dict"}


def branch_state(i: int, size: int) -> dict[str, Any]:
    return {
        "log": [f"step {i}"],
        "cost": i,
        "score": i % 7,
        "facts": {f"k{i}-{j}": "x" * 40 for j in range(max(1, size // 60))},
    }


def merge_cost(size: int, samples: int) -> list[float]:
    """5 branch states of ``size`` bytes, merged with the reducers (bench.merges)."""
    return merges.alma_merge(5, size, samples)


def completed(ctx: WorkflowContext, branch: str | None, updates: dict[str, Any]) -> Any:
    return NodeCompleted.model_validate(
        {
            "event_id": uuid.uuid4().hex,
            "type": "node.completed",
            "emitted_at": time.time(),
            "tenant_id": ctx.tenant_id,
            "workflow_id": ctx.workflow_id,
            "run_id": ctx.run_id,
            "node_id": "n",
            "branch_id": branch,
            "payload": {"updates": updates},
        },
        strict=False,
    )


async def join_latency(s: settings_mod.Settings, rate: float, joins: int) -> list[float]:
    services = Services(s.kafka_bootstrap or "", s.postgres_dsn or "", s.redis_url or "")
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_worker(s, services, ["checkpoint", "join"], stop, ready=ready))
    await asyncio.wait_for(ready.wait(), 60)
    latencies: list[float] = []
    async with AlmaClient(s) as client:
        ctxs = [
            WorkflowContext(tenant_id="bench", workflow_id="wf", run_id=uuid.uuid4().hex)
            for _ in range(joins)
        ]
        for ctx in ctxs:
            for i in range(5):
                await client.publish(completed(ctx, f"b{i}", branch_state(i, 5000)))

        async def one(ctx: WorkflowContext) -> None:
            started = time.perf_counter()
            await client.merge(
                ctx, branch_ids=[f"b{i}" for i in range(5)], reducers=REDUCERS, timeout=60
            )
            latencies.append(time.perf_counter() - started)

        await client.merge(ctxs[0], branch_ids=["b0"], timeout=60)  # warm the listener
        pending = []
        start = time.perf_counter()
        for n, ctx in enumerate(ctxs[1:]):
            delay = start + n / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            pending.append(asyncio.create_task(one(ctx)))
        await asyncio.gather(*pending)
    stop.set()
    await task
    return latencies


async def main(quick: bool, out: Path | None) -> None:
    rows: dict[str, list[list[str]]] = {"merge": [], "e2e": []}
    with Progress(console=console) as progress:
        async with stack(quick, 1, False, progress) as env:
            progress.update(env.task, description="joiner benchmarks", total=4)
            for size in (5_000, 50_000):
                cost = merge_cost(size, 200 if quick else 1000)
                rows["merge"].append([f"{size // 1000} KB", ms(cost, 50), ms(cost, 99)])
                env.done()
            for rate in (10, 50):
                lat = await join_latency(env.s, rate, 60 if quick else 300)
                rows["e2e"].append(
                    [str(rate), str(len(lat)), ms(lat, 50), ms(lat, 95), ms(lat, 99)]
                )
                env.done()
    headers = {
        "merge": ["branch state", "merge p50 ms", "merge p99 ms"],
        "e2e": ["offered joins/s", "joins", "request → reply p50 ms", "p95 ms", "p99 ms"],
    }
    titles = {
        "merge": "Merge of 5 branch states (reducers, canonical JSON, hash; no I/O)",
        "e2e": "Join request → reply through the SDK (5 branches of 5 KB, embedded stack)",
    }
    report("joiner", rows, headers, titles, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    asyncio.run(main(args.quick, args.out))
