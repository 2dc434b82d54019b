"""Fan-out / fan-in against a running `alma up`.

    alma up                                   # in one terminal
    python examples/fan_out_fan_in.py         # in another

Three branches research in parallel and write their findings; the join merges
them with reducers (append the findings, sum the costs, keep the best score) and
the merged state comes back as a durable checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from alma_core.sdk.client import AlmaClient
from alma_core.settings import load
from alma_core.types import WorkflowContext


def settings_of_running_stack() -> Any:
    """The services of `alma up` (from .alma/endpoints.json), or the ALMA_* variables."""
    endpoints = Path(".alma/endpoints.json")
    found = json.loads(endpoints.read_text()) if endpoints.exists() else {}
    keys = ("kafka_bootstrap", "postgres_dsn", "redis_url")
    return load(**{k: found[k] for k in keys if found.get(k)})


async def main(settings: Any) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    ctx = WorkflowContext(tenant_id="acme", workflow_id="research", run_id=run_id)
    async with AlmaClient(settings) as client:
        await client.node_completed(
            replace(ctx, node_id="plan"),
            updates={"question": "best vector index?", "findings": [], "cost": 0},
        )
        branches = {
            "web": ("HNSW is fast", 0.4, 0.7),
            "papers": ("IVF needs training", 0.9, 0.6),
            "code": ("exact scan wins below 10k rows", 0.2, 0.9),
        }
        for name, (finding, cost, score) in branches.items():
            await client.node_completed(
                replace(ctx, node_id=f"search-{name}", branch_id=name),
                updates={"findings": [finding], "cost": cost, "score": score},
            )
        reply = await client.merge(
            ctx,
            branch_ids=list(branches),
            node_id="synthesise",
            reducers={"findings": "append", "cost": "sum", "score": "max"},
            timeout=60,
        )
    print(f"run {ctx.run_id}: merged checkpoint seq {reply.checkpoint_seq}")
    print(json.dumps(reply.merged_state, indent=2))


if __name__ == "__main__":
    asyncio.run(main(settings_of_running_stack()))
