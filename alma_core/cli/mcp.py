"""``alma mcp``: ALMA Stream's tools for agents, as a Model Context Protocol server on
stdio, over the SDK (:class:`~alma_core.sdk.client.AlmaClient`).

Tools: ``alma_checkpoint`` (a node's state or updates, waits until durable),
``alma_get_resume_point``, ``alma_merge_states`` (awaits the joiner's reply),
``alma_learn_workflow`` (the run's outcome, learned from by the learner),
``alma_retrieve`` (memories for a task within a context and scope, with the prompt),
and a run's past: ``alma_state_at``, ``alma_diff``, ``alma_explain_merge``,
``alma_fork``.
Errors come back as tool errors whose text says what to do.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import typer

from alma_core import errors
from alma_core.cli import common
from alma_core.logs import configure as configure_logs
from alma_core.logs import redact
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.timeline import Timeline
from alma_core.settings import Settings
from alma_core.storage.cache_entries import checkpoint_to_doc
from alma_core.types import RetrievalScope, WorkflowContext

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

P = ParamSpec("P")
R = TypeVar("R")


def _tool_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """ALMA errors become tool errors the model can read (not a bare crash), with no
    password of a DSN in them."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from mcp.server.mcpserver.exceptions import ToolError

        try:
            return await fn(*args, **kwargs)
        except errors.AlmaError as exc:
            raise ToolError(f"{type(exc).__name__}: {redact(exc.message)}") from exc

    return wrapper


def register(app: typer.Typer) -> None:
    app.command("mcp")(mcp)


def build(client: AlmaClient) -> MCPServer:
    """The MCP server with ALMA Stream's tools over ``client`` (the library is imported
    only here, so the rest of the command line starts without it)."""
    from mcp.server.mcpserver import MCPServer

    server: MCPServer = MCPServer(
        "alma-stream",
        instructions="Workflow memory: checkpoints, resume points, branch merges, "
        "learning from finished runs and scoped retrieval of what was learned.",
    )

    @server.tool()
    @_tool_errors
    async def alma_checkpoint(
        tenant_id: str,
        workflow_id: str,
        run_id: str,
        node_id: str,
        state: dict[str, Any] | None = None,
        updates: dict[str, Any] | None = None,
        branch_id: str | None = None,
        expected_seq: int | None = None,
    ) -> dict[str, Any]:
        """Checkpoint a node: its full `state`, or `updates` folded into the run's state
        with the workflow's reducers. Waits until durable; returns the checkpoint seq."""
        ctx = WorkflowContext(tenant_id, workflow_id, None, run_id, node_id, branch_id)
        payload = {"state": state, "updates": updates, "expected_seq": expected_seq}
        event = client.event("node.completed", ctx, payload)
        applied = await client.publish(event, wait="applied")
        return {"event_id": applied.event_id, "effect": applied.effect, "seq": applied.seq}

    @server.tool()
    @_tool_errors
    async def alma_get_resume_point(
        tenant_id: str, workflow_id: str, run_id: str
    ) -> dict[str, Any]:
        """Where a run resumes after a crash: its latest checkpoint and branch heads; a
        run with no checkpoint yet resumes from the start (latest null, state {})."""
        point = await client.resume(WorkflowContext(tenant_id, workflow_id, None, run_id))
        if point.latest is None and point.status is None:
            raise errors.AlmaError(
                f"no run {run_id!r} of tenant {tenant_id!r}: check the ids; a run not started "
                "yet starts from the beginning, with an empty state"
            )
        return {
            "run_id": run_id,
            "status": point.status,
            "latest": checkpoint_to_doc(point.latest) if point.latest else None,
            "state": point.state,
            "branch_heads": {b or "": checkpoint_to_doc(c) for b, c in point.branch_heads.items()},
        }

    @server.tool()
    @_tool_errors
    async def alma_merge_states(
        tenant_id: str,
        workflow_id: str,
        run_id: str,
        branch_ids: list[str] | None = None,
        states: list[dict[str, Any]] | None = None,
        reducers: dict[str, str] | None = None,
        default_reducer: str | None = None,
        strict: bool | None = None,
        node_id: str = "join",
        join_id: str | None = None,
    ) -> dict[str, Any]:
        """Merge parallel branches (their latest states, by `branch_ids`, or the given
        `states`) with reducers per field; returns the merged state, already durable."""
        reply = await client.merge(
            WorkflowContext(tenant_id, workflow_id, None, run_id, node_id),
            branch_ids=branch_ids,
            states=states,
            reducers=reducers,
            default_reducer=default_reducer,
            strict=strict,
            join_id=join_id,
        )
        return reply.model_dump(mode="json", exclude_none=True)

    @server.tool()
    @_tool_errors
    async def alma_learn_workflow(
        tenant_id: str,
        workflow_id: str,
        run_id: str,
        success: bool,
        duration_ms: int,
        node_count: int,
        nodes_succeeded: int,
        nodes_failed: int,
        error_message: str | None = None,
        task: str | None = None,
        artifacts: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Record a finished run's outcome; the learner stores it with an embedding and
        learns heuristics and anti-patterns from it and earlier runs."""
        ctx = WorkflowContext(tenant_id, workflow_id, None, run_id)
        event_id = await client.workflow_completed(
            ctx,
            success=success,
            duration_ms=duration_ms,
            node_count=node_count,
            nodes_succeeded=nodes_succeeded,
            nodes_failed=nodes_failed,
            error_message=error_message,
            task=task,
            artifacts=artifacts,
            wait="applied",
        )
        applied = await client.applied(ctx, event_id)  # its effect, recorded by now
        return {"event_id": event_id, "effect": applied.effect}

    @server.tool()
    @_tool_errors
    async def alma_retrieve(
        task: str,
        tenant_id: str,
        workflow_id: str | None = None,
        run_id: str | None = None,
        node_id: str | None = None,
        scope: str = "workflow",
        agent: str | None = None,
        top_k: int = 5,
        max_tokens: int = 800,
    ) -> dict[str, Any]:
        """What was learned that bears on `task`, within `scope` (node, run, workflow,
        agent, tenant) of the context; items best first and a prompt within max_tokens."""
        try:
            chosen = RetrievalScope(scope.lower())
        except ValueError:
            names = ", ".join(s.value for s in RetrievalScope)
            raise errors.ContextError(f"unknown scope {scope!r}: one of {names}") from None
        found = await client.retrieve(
            task,
            WorkflowContext(tenant_id, workflow_id, None, run_id, node_id),
            chosen,
            agent=agent,
            top_k=top_k,
        )
        return found.to_doc(max_tokens)

    @server.tool()
    @_tool_errors
    async def alma_state_at(
        tenant_id: str, run_id: str, seq: int, branch_id: str | None = None
    ) -> dict[str, Any]:
        """A run's state as it was at `seq` (the main line's, or `branch_id`'s): its
        newest checkpoint at or below that seq."""
        found = await Timeline(client).state_at(
            WorkflowContext(tenant_id=tenant_id, run_id=run_id), seq, branch_id
        )
        if found is None:
            raise errors.ContextError(
                f"run {run_id!r} has no checkpoint at or before seq {seq} there: check the "
                "ids and the seq (alma_get_resume_point gives the latest)"
            )
        return checkpoint_to_doc(found)

    @server.tool()
    @_tool_errors
    async def alma_diff(tenant_id: str, run_id: str, a: int, b: int) -> dict[str, Any]:
        """What changed from checkpoint `a` to checkpoint `b` of a run: each path (JSON
        Pointer) added, removed or changed, with the values before and after."""
        changes = await Timeline(client).diff(
            WorkflowContext(tenant_id=tenant_id, run_id=run_id), a, b
        )
        return {"run_id": run_id, "a": a, "b": b, "changes": [c.to_doc() for c in changes]}

    @server.tool()
    @_tool_errors
    async def alma_explain_merge(tenant_id: str, run_id: str, seq: int) -> dict[str, Any]:
        """Merged checkpoint `seq` of a run beside its inputs: for each field, the reducer
        that folded it, the main line's value before, each input's value and the result."""
        view = await Timeline(client).merge(
            WorkflowContext(tenant_id=tenant_id, run_id=run_id), seq
        )
        return view.to_doc()

    @server.tool()
    @_tool_errors
    async def alma_fork(
        tenant_id: str,
        run_id: str,
        seq: int,
        new_run_id: str,
        branch_id: str | None = None,
        patch: list[dict[str, Any]] | None = None,
        note: str | None = None,
        asked_by: str | None = None,
    ) -> dict[str, Any]:
        """Start run `new_run_id` from `run_id`'s state at `seq` (same tenant and
        workflow; its first checkpoint records the lineage), edited first by `patch`, a
        JSON Patch (RFC 6902), when given: refused, writing nothing, if it does not
        apply. `note` (why) and `asked_by` (who) are kept in the lineage. Asked again:
        the same fork."""
        ctx = WorkflowContext(tenant_id=tenant_id, run_id=run_id)
        applied = await Timeline(client).fork(
            ctx, seq, new_run_id, branch_id=branch_id, patch=patch, note=note, asked_by=asked_by
        )
        return {"run_id": new_run_id, "event_id": applied.event_id, "seq": applied.seq}

    return server


async def run_stdio(settings: Settings) -> None:
    async with AlmaClient(settings) as client:
        await build(client).run_stdio_async()


def mcp() -> None:
    """Serve ALMA Stream's tools to agents over MCP (stdio): alma_checkpoint,
    alma_get_resume_point, alma_merge_states, alma_learn_workflow, alma_retrieve,
    alma_state_at, alma_diff, alma_explain_merge, alma_fork."""
    if importlib.util.find_spec("mcp") is None:
        common.fail("`alma mcp` needs the mcp extra: pip install 'alma-stream[mcp]'", common.USAGE)
    s = common.settings()
    configure_logs(s.log_format, "WARNING")  # stdout is the protocol: logs go to stderr
    common.run(lambda: run_stdio(common.resolved(s)))  # a missing service: message, exit 2
