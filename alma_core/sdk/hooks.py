"""WorkflowHooks: the orchestrator's callbacks (the AGtestari orchestrator's
``on_node_start``, ``on_node_complete``, ``on_parallel_join``, ``on_workflow_complete``,
``on_resume``; plus ``on_workflow_start``, which checkpoints the run's input, and
``on_node_failed``)
on top of :class:`~alma_core.sdk.client.AlmaClient`, ready to register with a workflow
engine. The hooks keep count of what they saw of each run (nodes, retries,
failures, time), so ``on_workflow_complete`` fills the outcome's counts itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from alma_core.sdk.client import AlmaClient
from alma_core.sdk.publisher import Wait
from alma_core.types import WorkflowContext


@dataclass
class RunTally:
    """What the hooks saw of one run: each node's last status, and its start."""

    started: float = field(default_factory=time.monotonic)
    last_status: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(1 for s in self.last_status.values() if s == "failed")

    @property
    def succeeded(self) -> int:
        return sum(1 for s in self.last_status.values() if s == "completed")


class WorkflowHooks:
    """``durable`` (default): a node's hook returns once its checkpoint is durable, so a
    crash right after it resumes past that node; False returns once Kafka has it."""

    def __init__(self, client: AlmaClient, *, durable: bool = True) -> None:
        self.client = client
        self.durable = durable
        self.tallies: dict[str, RunTally] = {}
        self.checkpoint_seconds: list[float] = []  # publish → durable, per durable hook
        self.merge_seconds: list[float] = []  # join request → durable merged reply

    @property
    def _wait(self) -> Wait:
        return "applied" if self.durable else "published"

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Time a durable hook, publish to durable, into ``checkpoint_seconds``."""
        started = time.perf_counter()
        yield
        if self.durable:
            self.checkpoint_seconds.append(time.perf_counter() - started)

    def _tally(self, ctx: WorkflowContext) -> RunTally:
        return self.tallies.setdefault(ctx.run_id or "", RunTally())

    async def on_workflow_start(
        self, ctx: WorkflowContext, state: dict[str, Any], *, node_id: str = "start"
    ) -> str:
        """Checkpoint the run's input as its first state (not counted as a node)."""
        self._tally(ctx)
        at = replace(ctx, node_id=node_id, branch_id=None)
        with self._timed():
            return await self.client.node_completed(at, state=state, wait=self._wait)

    async def on_node_start(
        self,
        ctx: WorkflowContext,
        *,
        attempt: int | None = None,
        input: dict[str, Any] | None = None,
    ) -> str:
        """Record the start (audit trail and metrics; no checkpoint)."""
        self._tally(ctx).last_status.setdefault(ctx.node_id or "", "started")
        return await self.client.node_started(ctx, attempt=attempt, input=input)

    async def on_node_complete(
        self,
        ctx: WorkflowContext,
        state: dict[str, Any] | None = None,
        *,
        updates: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        """Checkpoint the node: its full ``state`` or its ``updates``."""
        with self._timed():
            event_id = await self.client.node_completed(
                ctx, state=state, updates=updates, metadata=metadata, wait=self._wait
            )
        self._tally(ctx).last_status[ctx.node_id or ""] = "completed"
        return event_id

    async def on_node_failed(
        self,
        ctx: WorkflowContext,
        error: BaseException,
        *,
        state: dict[str, Any] | None = None,
        updates: dict[str, Any] | None = None,
    ) -> str:
        """Record the failure (a ``failure`` checkpoint if state or updates are given);
        a later completion of the same node (a retry) counts it as succeeded."""
        with self._timed():
            event_id = await self.client.node_failed(
                ctx,
                error_type=type(error).__name__,
                message=str(error),
                state=state,
                updates=updates,
                wait=self._wait,
            )
        self._tally(ctx).last_status[ctx.node_id or ""] = "failed"
        return event_id

    async def on_parallel_join(
        self,
        ctx: WorkflowContext,
        *,
        branch_ids: list[str] | None = None,
        states: list[dict[str, Any]] | None = None,
        reducers: dict[str, str] | None = None,
        default_reducer: str | None = None,
        strict: bool | None = None,
        join_id: str | None = None,
        timeout: float = 30.0,  # noqa: ASYNC109 - SDK parameter
    ) -> dict[str, Any]:
        """Merge the branches with reducers; the merged state (already durable)."""
        started = time.perf_counter()
        reply = await self.client.merge(
            ctx,
            branch_ids=branch_ids,
            states=states,
            reducers=reducers,
            default_reducer=default_reducer,
            strict=strict,
            join_id=join_id,
            timeout=timeout,
        )
        self.merge_seconds.append(time.perf_counter() - started)
        self._tally(ctx).last_status[ctx.node_id or "join"] = "completed"
        return dict(reply.merged_state or {})

    async def on_workflow_complete(
        self,
        ctx: WorkflowContext,
        *,
        task: str | None = None,
        success: bool | None = None,
        error_message: str | None = None,
        artifacts: list[dict[str, Any]] | None = None,
        cleanup_checkpoints: bool | None = None,
    ) -> str:
        """Hand the run to the learner; counts and duration come from the tally
        (``success`` defaults to "no node's last attempt failed")."""
        tally = self.tallies.pop(ctx.run_id or "", RunTally())
        ok = tally.failed == 0 if success is None else success
        return await self.client.workflow_completed(
            replace(ctx, node_id=None, branch_id=None),
            success=ok,
            duration_ms=int((time.monotonic() - tally.started) * 1000),
            node_count=len(tally.last_status),
            nodes_succeeded=tally.succeeded,
            nodes_failed=tally.failed,
            error_message=error_message,
            task=task,
            artifacts=artifacts,
            cleanup_checkpoints=cleanup_checkpoints,
        )

    async def on_resume(self, ctx: WorkflowContext) -> tuple[str | None, dict[str, Any]]:
        """After a crash: the node the run last checkpointed and the state to go on from
        (``(None, {})`` for a run with no checkpoint: start it over). The tally
        restarts from the checkpoints' nodes."""
        point = await self.client.resume(ctx)
        tally = self._tally(ctx)
        for head in point.branch_heads.values():
            if head.node_id:
                tally.last_status.setdefault(head.node_id, "completed")
        main = point.branch_heads.get(None)
        return (main.node_id if main else None), point.state
