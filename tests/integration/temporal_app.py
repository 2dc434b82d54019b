"""Workflows and activities the Temporal tests run on a real Temporal server, and a
worker process (``python -m tests.integration.temporal_app``) for the crash test.

The activities are what an AGtestari workflow does: plain async functions returning
dicts; one is flaky (it fails until its third attempt), one returns what is not JSON,
one returns a state over the size limit. The workflows use the plugin's workflow side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

from alma_core.integrations.temporal import workflow as alma
from alma_core.integrations.temporal.worker import AlmaPlugin, retrieve
from alma_core.settings import load

T = timedelta(seconds=20)
FAST_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=100), backoff_coefficient=1.0)


# --- activities ---------------------------------------------------------------------------


@activity.defn
async def plan(topic: str) -> dict[str, Any]:
    return {"topic": topic, "steps": ["fetch", "write"]}


@activity.defn
async def fetch(topic: str) -> dict[str, Any]:
    return {"sources": [f"web:{topic}"], "pages": 3}


@activity.defn
async def write(topic: str) -> dict[str, Any]:
    return {"draft": f"a report on {topic}"}


@activity.defn
async def note(text: str) -> dict[str, Any]:
    return {"notes": [text], "count": 1}


@activity.defn
async def blob(name: str) -> bytes:
    return b"\x89PNG raw bytes"  # not JSON: recorded as a node, not as state


@activity.defn
async def review(section: str) -> dict[str, Any]:
    """One reviewer's notes, risk and effort: the branches of the fan-out."""
    risk = {"legal": 3, "finance": 7, "security": 5}[section]
    return {"notes": [f"{section} ok"], "risk": risk, "hours": 2}


@activity.defn
async def flaky(topic: str) -> dict[str, Any]:
    info = activity.info()
    if info.attempt < 3:
        raise RuntimeError(f"upstream 503 on attempt {info.attempt}")
    return {"fetched_on_attempt": info.attempt}


class Opaque:
    """Neither JSON nor anything Temporal's converter knows."""


@activity.defn
async def opaque(topic: str) -> Any:
    return {"handle": Opaque()}


@activity.defn
async def not_a_number(topic: str) -> Any:
    return {"score": float("nan")}  # Temporal's JSON takes NaN; JSON itself does not


@activity.defn
async def bad_hours(topic: str) -> dict[str, Any]:
    return {"hours": "many"}  # the workflow sums hours: a reducer refuses a string


@activity.defn
async def too_big(topic: str) -> dict[str, Any]:
    return {"blob": "x" * 100_000}


@activity.defn
async def deliver(topic: str) -> dict[str, Any]:
    raise ApplicationError("the printer is on fire", non_retryable=True)


@activity.defn
async def recall(task: str) -> dict[str, str]:
    """Retrieval from inside an activity, the run's context filled in: what this
    workflow learned (nothing yet), and what the Research workflow learned."""
    own = await retrieve(task)
    research = await retrieve(task, workflow="Research")
    return {"own": own.to_prompt(max_tokens=400), "research": research.to_prompt(max_tokens=400)}


@activity.defn
async def check(section: str) -> dict[str, Any]:
    if section == "b":
        raise ApplicationError(f"section {section} cannot be checked", non_retryable=True)
    return {"checked": [section]}


# --- workflows ------------------------------------------------------------------------------


@workflow.defn
class Research:
    @workflow.run
    async def run(self, topic: str) -> dict[str, Any]:
        alma.set_task(f"write a research report on {topic}")
        out: dict[str, Any] = {}
        for step in (plan, fetch, write):
            out |= await workflow.execute_activity(step, topic, start_to_close_timeout=T)
        return out


@workflow.defn
class Review:
    @workflow.run
    async def run(self, topic: str) -> dict[str, Any]:
        await workflow.execute_activity(plan, topic, start_to_close_timeout=T)
        await asyncio.gather(
            *(
                alma.execute_activity(review, section, branch=section, start_to_close_timeout=T)
                for section in ("legal", "finance", "security")
            )
        )
        return await alma.join(
            ["legal", "finance", "security"],
            reducers={"notes": "append", "risk": "max", "hours": "sum"},
        )


@workflow.defn
class Notes:
    """Two activities writing the same fields: the plugin's reducers fold them."""

    @workflow.run
    async def run(self, topic: str) -> None:
        for text in ("first", "second"):
            await workflow.execute_activity(note, text, start_to_close_timeout=T)
        await alma.execute_activity(blob, "chart", result="ignore", start_to_close_timeout=T)


@workflow.defn
class Flaky:
    @workflow.run
    async def run(self, topic: str) -> dict[str, Any]:
        got: dict[str, Any] = await workflow.execute_activity(
            flaky, topic, start_to_close_timeout=T, retry_policy=FAST_RETRY
        )
        return got


@workflow.defn
class Broken:
    """Runs one activity (or join) whose result ALMA refuses, named by ``kind``."""

    @workflow.run
    async def run(self, kind: str) -> dict[str, Any]:
        if kind == "unknown_reducer":
            await alma.execute_activity(review, "legal", branch="legal", start_to_close_timeout=T)
            return await alma.join(["legal"], reducers={"risk": "no_such_reducer"})
        if kind == "reducer_type":
            await workflow.execute_activity(review, "legal", start_to_close_timeout=T)
        step = {
            "opaque": opaque,
            "not_a_number": not_a_number,
            "too_big": too_big,
            "reducer_type": bad_hours,
        }[kind]
        got: dict[str, Any] = await workflow.execute_activity(
            step, kind, start_to_close_timeout=T, retry_policy=FAST_RETRY
        )
        return got


@workflow.defn
class Recall:
    @workflow.run
    async def run(self, task: str) -> dict[str, str]:
        prompts: dict[str, str] = await workflow.execute_activity(
            recall, task, start_to_close_timeout=T
        )
        return prompts


@workflow.defn
class Delivery:
    """Two steps; the worker process dies right after the first one is durable."""

    @workflow.run
    async def run(self, topic: str) -> dict[str, Any]:
        out: dict[str, Any] = await workflow.execute_activity(
            plan, topic, start_to_close_timeout=timedelta(seconds=3), retry_policy=FAST_RETRY
        )
        out |= await workflow.execute_activity(write, topic, start_to_close_timeout=T)
        return out


@workflow.defn
class Resumable:
    """Plan, fetch, then a delivery that fails; a new run of the same workflow id,
    told the failed run, resumes from ALMA's checkpoint instead of starting over."""

    @workflow.run
    async def run(self, failed_run: str) -> dict[str, Any]:
        if failed_run:
            point = await alma.resume(failed_run)
            return {"at": (point.kind, point.node_id, point.seq), "state": point.state}
        for step in (plan, fetch, deliver):
            await workflow.execute_activity(step, "parcels", start_to_close_timeout=T)
        return {}


@workflow.defn
class Tolerant:
    """One activity three times in a row, then two branches of one activity, one of which
    fails for good and the workflow goes on: five nodes, one failed."""

    @workflow.run
    async def run(self, topic: str) -> None:
        for _ in range(3):
            await workflow.execute_activity(note, topic, start_to_close_timeout=T)
        await asyncio.gather(
            *(
                alma.execute_activity(check, section, branch=section, start_to_close_timeout=T)
                for section in ("a", "b")
            ),
            return_exceptions=True,
        )


WORKFLOWS = [Research, Review, Notes, Flaky, Broken, Recall, Delivery, Resumable, Tolerant]
ACTIVITIES = [
    blob,
    check,
    note,
    plan,
    fetch,
    write,
    review,
    flaky,
    opaque,
    not_a_number,
    bad_hours,
    too_big,
    recall,
    deliver,
]


# --- the worker process of the crash test -------------------------------------------------


class _DieAfterPublishing(ActivityInboundInterceptor):
    """Outermost: the activity has run and ALMA has made its checkpoint durable; the
    process dies before Temporal hears of the completion (once: the marker file)."""

    def __init__(self, next: ActivityInboundInterceptor, marker: Path) -> None:
        super().__init__(next)
        self.marker = marker

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        result = await self.next.execute_activity(input)
        if activity.info().activity_type == "plan" and self.marker.exists():
            self.marker.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        return result


class DieAfterPublishing(Interceptor):
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _DieAfterPublishing(next, self.marker)


async def serve(address: str, task_queue: str, marker: Path) -> None:
    """A Temporal worker with ALMA's plugin until SIGTERM (ALMA settings from ALMA_*)."""
    client = await Client.connect(address)
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        activities=ACTIVITIES,
        interceptors=[DieAfterPublishing(marker)],
        plugins=[AlmaPlugin(load(), tenant_id="acme")],
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with worker:
        print("temporal worker running", flush=True)
        await stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--task-queue", required=True)
    parser.add_argument("--marker", required=True, type=Path)
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.task_queue, args.marker))
    sys.exit(0)
