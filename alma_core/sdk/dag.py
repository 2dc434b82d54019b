"""A small orchestrator for series-parallel DAG workflows, wired to ALMA Stream through
:class:`~alma_core.sdk.hooks.WorkflowHooks` (every hook). The demo and ``examples/`` run
their workflows with it; a real engine (Temporal, Airflow, LangGraph) calls the same
hooks from its own callbacks.

A workflow is a list of steps run in order. A :class:`Node` turns the state into
updates (and may be retried); a :class:`Parallel` runs its branches concurrently,
each a list of nodes with its own branch state, then joins them with reducers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from alma_core.reducers import ReducerConfig, apply_updates
from alma_core.sdk.hooks import WorkflowHooks
from alma_core.types import WorkflowContext

NodeFn = Callable[[dict[str, Any], int], Awaitable[dict[str, Any]]]  # (state, attempt) -> updates


@dataclass(frozen=True)
class Node:
    id: str
    fn: NodeFn
    retries: int = 0


@dataclass(frozen=True)
class Parallel:
    """Branches run concurrently, then join (with the workflow's reducers, unless
    ``reducers`` are given for this join)."""

    id: str  # the join's node id
    branches: dict[str, list[Node]]
    reducers: dict[str, str] | None = None


Step = Node | Parallel


@dataclass(frozen=True)
class Workflow:
    """``reducers`` (field -> reducer) are registered for the workflow before its first
    run: node ``updates`` and joins of every run then fold with them."""

    id: str
    steps: list[Step]
    reducers: dict[str, str] = field(default_factory=dict)


class SimulatedCrash(Exception):
    """Raised after the named step to play an orchestrator that dies mid-run."""


@dataclass
class RunResult:
    run_id: str
    success: bool
    state: dict[str, Any]
    error: str | None = None
    resumed_after: str | None = None


class NodeFailed(Exception):
    def __init__(self, node_id: str, error: BaseException) -> None:
        super().__init__(f"node {node_id} failed: {error}")
        self.node_id = node_id
        self.error = error


class Orchestrator:
    def __init__(self, hooks: WorkflowHooks) -> None:
        self.hooks = hooks
        self._registered: set[tuple[str | None, str]] = set()

    async def run(
        self,
        wf: Workflow,
        ctx: WorkflowContext,
        *,
        task: str,
        state: dict[str, Any] | None = None,
        crash_after: str | None = None,
        start_at: int = 0,
        resumed_after: str | None = None,
    ) -> RunResult:
        """Run ``wf`` from step ``start_at``; hands the outcome to the learner at the end."""
        current = dict(state or {})
        if wf.reducers and (ctx.tenant_id, wf.id) not in self._registered:
            await self.hooks.client.register_reducers(ctx, wf.reducers)
            self._registered.add((ctx.tenant_id, wf.id))
        if start_at == 0:
            await self.hooks.on_workflow_start(ctx, current)
        config = ReducerConfig(field_reducers=wf.reducers)
        try:
            for step in wf.steps[start_at:]:
                if isinstance(step, Node):  # fold as the checkpointer does
                    current = apply_updates(current, await self._node(step, ctx, current), config)
                else:
                    current = await self._parallel(step, ctx, current)
                if step.id == crash_after:
                    raise SimulatedCrash(f"orchestrator died after {step.id}")
        except NodeFailed as exc:
            await self.hooks.on_workflow_complete(
                ctx, task=task, success=False, error_message=str(exc.error)
            )
            return RunResult(ctx.run_id or "", False, current, str(exc), resumed_after)
        await self.hooks.on_workflow_complete(ctx, task=task)
        return RunResult(ctx.run_id or "", True, current, None, resumed_after)

    async def resume(self, wf: Workflow, ctx: WorkflowContext, *, task: str) -> RunResult:
        """Pick a run up where its last durable checkpoint left it."""
        node_id, state = await self.hooks.on_resume(ctx)
        ids = [s.id for s in wf.steps]
        start = ids.index(node_id) + 1 if node_id in ids else 0
        return await self.run(
            wf, ctx, task=task, state=state, start_at=start, resumed_after=node_id
        )

    async def _node(
        self,
        node: Node,
        ctx: WorkflowContext,
        state: dict[str, Any],
        branch: str | None = None,
    ) -> dict[str, Any]:
        at = replace(ctx, node_id=node.id, branch_id=branch)
        for attempt in range(1, node.retries + 2):
            await self.hooks.on_node_start(at, attempt=attempt)
            try:
                updates = await node.fn(state, attempt)
            except Exception as exc:
                await self.hooks.on_node_failed(at, exc)
                if attempt > node.retries:
                    raise NodeFailed(node.id, exc) from exc
                continue
            await self.hooks.on_node_complete(at, updates=updates)
            return updates
        raise AssertionError("unreachable")  # pragma: no cover

    async def _parallel(
        self, step: Parallel, ctx: WorkflowContext, state: dict[str, Any]
    ) -> dict[str, Any]:
        async def branch(branch_id: str, nodes: list[Node]) -> None:
            local = dict(state)  # a node's input; the branch's checkpoints hold its updates
            for node in nodes:
                local = {**local, **await self._node(node, ctx, local, branch_id)}

        await asyncio.gather(*(branch(b, nodes) for b, nodes in step.branches.items()))
        merged = await self.hooks.on_parallel_join(
            replace(ctx, node_id=step.id),
            branch_ids=list(step.branches),
            reducers=step.reducers,
        )
        return merged  # the main line's head with the branches folded in
