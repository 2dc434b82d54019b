"""A small orchestrator running DAG workflows against a running `alma up`, using
every hook: on_workflow_start, on_node_start, on_node_complete, on_node_failed (a
flaky node retried), on_parallel_join (fan-out / fan-in with reducers),
on_workflow_complete (the learner learns from it), and on_resume (a crash, then a
new orchestrator picks the run up at its latest checkpoint).

    alma up                                   # in one terminal
    python examples/dag_orchestrator.py       # in another

The services come from .alma/endpoints.json (written by `alma up`) or the ALMA_*
variables. Then: `alma runs list --tenant acme --workflow etl-with-review`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

from alma_core.sdk.client import AlmaClient
from alma_core.sdk.dag import Node, Orchestrator, Parallel, SimulatedCrash, Workflow
from alma_core.sdk.hooks import WorkflowHooks
from alma_core.settings import Settings, load
from alma_core.types import RetrievalScope, WorkflowContext


def settings_of_running_stack() -> Settings:
    endpoints = Path(load().data_dir) / "endpoints.json"
    found = json.loads(endpoints.read_text()) if endpoints.exists() else {}
    keys = ("kafka_bootstrap", "postgres_dsn", "redis_url")
    return load(**{k: found[k] for k in keys if found.get(k)})


class Flaky(Exception):
    pass


async def extract(state: dict[str, Any], attempt: int) -> dict[str, Any]:
    return {"rows": 1000, "log": ["extracted 1000 rows"]}


async def clean(state: dict[str, Any], attempt: int) -> dict[str, Any]:
    return {"rows_dropped": 12, "log": ["dropped 12 bad rows"], "cost": 0.4}


async def enrich(state: dict[str, Any], attempt: int) -> dict[str, Any]:
    return {"log": ["joined the customer table"], "cost": 1.1}


async def load_rows(state: dict[str, Any], attempt: int) -> dict[str, Any]:
    if attempt == 1:
        raise Flaky("warehouse connection reset")  # on_node_failed, then a retry
    return {"loaded": state["rows"] - state.get("rows_dropped", 0), "log": ["loaded"]}


ETL = Workflow(
    "etl-with-review",
    [
        Node("extract", extract),
        Parallel("prepare", {"clean": [Node("clean", clean)], "enrich": [Node("enrich", enrich)]}),
        Node("load", load_rows, retries=2),
    ],
    reducers={"log": "append", "cost": "sum", "rows_dropped": "max"},
)


async def main() -> None:
    settings = settings_of_running_stack()
    tag = uuid.uuid4().hex[:6]
    async with AlmaClient(settings) as client:
        orch = Orchestrator(WorkflowHooks(client))
        for i in range(3):
            ctx = WorkflowContext("acme", ETL.id, "v1", f"etl-{tag}-{i}")
            result = await orch.run(ETL, ctx, task="nightly customer ETL", state={"day": i})
            print(f"{result.run_id}: success={result.success} state={result.state}")
        crashed = WorkflowContext("acme", ETL.id, "v1", f"etl-{tag}-crash")
        with contextlib.suppress(SimulatedCrash):
            await orch.run(ETL, crashed, task="nightly customer ETL", crash_after="prepare")
        print(f"{crashed.run_id}: the orchestrator died after 'prepare'")
    async with AlmaClient(settings) as fresh:  # a new orchestrator process
        result = await Orchestrator(WorkflowHooks(fresh)).resume(
            ETL, crashed, task="nightly customer ETL"
        )
        print(
            f"{result.run_id}: resumed after {result.resumed_after!r}, success={result.success}, "
            f"state={result.state}"
        )
        await asyncio.sleep(2)  # the learner stores the outcomes
        found = await fresh.retrieve(
            "customer ETL", WorkflowContext("acme", ETL.id), RetrievalScope.WORKFLOW
        )
        print(found.to_prompt(max_tokens=300) or "(nothing learned yet: is the learner running?)")


if __name__ == "__main__":
    asyncio.run(main())
