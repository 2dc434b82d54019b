"""The workflow and activity the Temporal benchmark runs (their own module: Temporal's
sandbox imports it, so it imports nothing but temporalio)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import activity, workflow


@activity.defn
async def step(i: int) -> dict[str, Any]:
    """A node's work: nothing, and a 1 KB state to checkpoint."""
    return {"step": i, "notes": "x" * 1000}


@workflow.defn
class Chain:
    """``n`` activities one after the other."""

    @workflow.run
    async def run(self, n: int) -> int:
        for i in range(n):
            await workflow.execute_activity(step, i, start_to_close_timeout=timedelta(seconds=60))
        return n
