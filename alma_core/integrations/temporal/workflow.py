"""The workflow side: what a Temporal workflow calls, and the workflow interceptor the
plugin (:class:`~alma_core.integrations.temporal.worker.AlmaPlugin`) installs.

Deterministic, like all workflow code: nothing here does I/O. The interceptor puts
the run's ALMA context in a header of every activity it starts (the activity worker
publishes the node's events), keeps count of each node's outcome as the activity
handles resolve, and, when the workflow returns or fails, runs ALMA's ``alma.complete``
activity so the outcome is learned. Joins and resume points are ALMA's activities too.

    from alma_core.integrations.temporal import workflow as alma

    @workflow.defn
    class DocumentReview:
        @workflow.run
        async def run(self, doc: Document) -> dict:
            alma.set_task(f"review {doc.title}")
            await workflow.execute_activity(review, doc, start_to_close_timeout=T)
            await asyncio.gather(
                alma.execute_activity(legal, doc, branch="legal", start_to_close_timeout=T),
                alma.execute_activity(finance, doc, branch="finance", start_to_close_timeout=T),
            )
            return await alma.join(["legal", "finance"], reducers={"notes": "append"})

A plain ``workflow.execute_activity`` is a node on the main line named after the
activity type, its result folded into the run's state as ``updates``.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import FailureError
from temporalio.worker import (
    ExecuteWorkflowInput,
    HandleSignalInput,
    HandleUpdateInput,
    StartActivityInput,
    StartLocalActivityInput,
    WorkflowInboundInterceptor,
    WorkflowOutboundInterceptor,
)

from alma_core import errors
from alma_core.integrations.temporal import mapping
from alma_core.integrations.temporal.mapping import (
    CompleteRequest,
    JoinRequest,
    NodeHeader,
    NodeOptions,
    ResultMode,
    ResumePoint,
    ResumeRequest,
)

TenantOf = Callable[[workflow.Info], str]


@dataclass(frozen=True)
class WorkflowSettings:
    """The plugin's settings for every workflow of a worker. ``tenant_id`` may be a
    function of the workflow's info: it runs in workflow code, so it must be
    deterministic (the namespace, the workflow type, a memo or a search attribute)."""

    tenant_id: str | TenantOf | None = None
    workflow_version: str | None = None
    complete_runs: bool = True
    task_queue: str | None = None  # where ALMA's own activities run (default: the workflow's)
    activity_timeout: timedelta = timedelta(seconds=60)


@dataclass
class _Run:
    """One workflow run as the interceptor sees it: its ALMA identity and its nodes."""

    settings: WorkflowSettings
    base: NodeHeader
    namespace: str
    workflow_id: str
    temporal_run_id: str
    task: str | None = None
    # each activity execution's last outcome (started|completed|failed), in call order: an
    # activity called three times is three nodes, and a failed branch is never hidden by
    # a sibling of the same name that succeeded
    nodes: list[str] = field(default_factory=list)
    completed: bool = False
    joins: int = 0

    def header(self, options: NodeOptions) -> NodeHeader:
        return NodeHeader(
            tenant_id=self.base.tenant_id,
            workflow_id=self.base.workflow_id,
            run_id=self.base.run_id,
            workflow_version=self.base.workflow_version,
            node_id=options.node_id,
            branch_id=options.branch_id,
            result=options.result,
            key=options.key,
            fields=list(options.fields) if options.fields is not None else None,
        )

    def track(self, node_id: str, handle: asyncio.Future[Any]) -> None:
        """One execution of node ``node_id``: its last outcome, once Temporal has
        finished retrying it."""
        index = len(self.nodes)
        self.nodes.append("started")

        def finished(done: asyncio.Future[Any]) -> None:
            if not done.cancelled():
                self.nodes[index] = "failed" if done.exception() is not None else "completed"

        handle.add_done_callback(finished)

    def activity_options(self) -> dict[str, Any]:
        return {
            "start_to_close_timeout": self.settings.activity_timeout,
            "task_queue": self.settings.task_queue,
        }


_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("alma_run", default=None)
_NODE: contextvars.ContextVar[NodeOptions | None] = contextvars.ContextVar(
    "alma_node", default=None
)


def _current(what: str) -> _Run:
    run = _RUN.get()
    if run is None:
        raise errors.ConfigError(
            f"alma.{what}() needs ALMA's plugin on this worker: "
            "Worker(client, ..., plugins=[AlmaPlugin(settings)])"
        )
    return run


# --- what a workflow author calls ------------------------------------------------------


def start_activity(
    activity: Any,
    *args: Any,
    node: str | None = None,
    branch: str | None = None,
    result: ResultMode = "updates",
    key: str | None = None,
    fields: Sequence[str] | None = None,
    **options: Any,
) -> workflow.ActivityHandle[Any]:
    """``workflow.start_activity`` with the node's ALMA name, branch and result mapping
    (see :mod:`~alma_core.integrations.temporal.mapping`); ``options`` are Temporal's."""
    _current("start_activity")
    token = _NODE.set(NodeOptions(node, branch, result, key, tuple(fields) if fields else None))
    try:
        return workflow.start_activity(activity, args=list(args), **options)
    finally:
        _NODE.reset(token)


async def execute_activity(
    activity: Any,
    *args: Any,
    node: str | None = None,
    branch: str | None = None,
    result: ResultMode = "updates",
    key: str | None = None,
    fields: Sequence[str] | None = None,
    **options: Any,
) -> Any:
    """:func:`start_activity`, awaited: the activity's result."""
    handle = start_activity(
        activity, *args, node=node, branch=branch, result=result, key=key, fields=fields, **options
    )
    return await handle


def set_task(task: str) -> None:
    """The text the run's outcome is learned under (what retrieval compares a later
    task with). Also settable at start with the memo ``alma.task``."""
    _current("set_task").task = task


async def join(
    branch_ids: Sequence[str] | None = None,
    *,
    states: Sequence[dict[str, Any]] | None = None,
    reducers: dict[str, str] | None = None,
    default_reducer: str | None = None,
    strict: bool | None = None,
    node: str = "join",
    timeout: timedelta = timedelta(seconds=30),  # noqa: ASYNC109 - the reply's wait, sent on
) -> dict[str, Any]:
    """Merge the latest states of ``branch_ids`` (in that order) or the given ``states``
    with reducers; returns the merged state, already the run's next durable
    checkpoint. A join that cannot merge (a missing branch, an unknown reducer, a
    strict conflict) fails the activity with an ``ApplicationError`` naming it, never
    retried; a join retried after a timeout is answered once (its join id is fixed by
    the workflow's history)."""
    run = _current("join")
    run.joins += 1
    request = JoinRequest(
        join_id=f"{node}-{run.joins}",
        branch_ids=list(branch_ids) if branch_ids is not None else None,
        states=list(states) if states is not None else None,
        reducers=reducers,
        default_reducer=default_reducer,
        strict=strict,
        node_id=node,
        timeout_s=timeout.total_seconds(),
    )
    merged: dict[str, Any] = await workflow.execute_activity(
        "alma.join", request, result_type=dict, **run.activity_options()
    )
    return merged


async def resume(temporal_run_id: str | None = None) -> ResumePoint:
    """Where an ALMA run of this workflow id stands: by default the run this one
    continued (continue-as-new), else this run. Pass a run id to pick up after a
    failed or terminated run."""
    run = _current("resume")
    info = workflow.info()
    request = ResumeRequest(temporal_run_id or info.continued_run_id or info.run_id)
    point: ResumePoint = await workflow.execute_activity(
        "alma.resume", request, result_type=ResumePoint, **run.activity_options()
    )
    return point


async def complete(
    *,
    success: bool | None = None,
    error_message: str | None = None,
    task: str | None = None,
    artifacts: list[dict[str, Any]] | None = None,
    cleanup_checkpoints: bool | None = None,
) -> None:
    """Finish the run now (the plugin does it when the workflow returns or fails):
    counts (each activity execution a node) and duration from what the workflow saw;
    ``success`` defaults to "no activity execution ended failed" (after its retries),
    even one the workflow tolerated."""
    await _complete(
        _current("complete"),
        success=success,
        error_message=error_message,
        task=task,
        artifacts=artifacts,
        cleanup_checkpoints=cleanup_checkpoints,
    )


async def _complete(
    run: _Run,
    *,
    success: bool | None = None,
    error_message: str | None = None,
    task: str | None = None,
    artifacts: list[dict[str, Any]] | None = None,
    cleanup_checkpoints: bool | None = None,
) -> None:
    if run.completed:
        return
    run.completed = True  # once, even if the activity below fails the workflow
    failed = run.nodes.count("failed")
    elapsed = workflow.now() - workflow.info().start_time
    request = CompleteRequest(
        success=failed == 0 if success is None else success,
        duration_ms=max(0, int(elapsed.total_seconds() * 1000)),
        node_count=len(run.nodes),
        nodes_succeeded=run.nodes.count("completed"),
        nodes_failed=failed,
        error_message=error_message,
        task=task or run.task,
        artifacts=artifacts,
        cleanup_checkpoints=cleanup_checkpoints,
    )
    retry = RetryPolicy(maximum_interval=timedelta(seconds=10))
    if run.settings.task_queue is None and workflow.patched(mapping.PATCH_LOCAL_COMPLETE):
        # a local activity, in this worker: no round trip through Temporal's server to
        # schedule and match it (two markers in the history, the patch's and its own,
        # where a scheduled activity took six events). Workflows that began before
        # this release and completed with a scheduled one replay as they ran
        await workflow.execute_local_activity(
            "alma.complete",
            request,
            retry_policy=retry,
            start_to_close_timeout=run.settings.activity_timeout,
        )
        return
    await workflow.execute_activity(
        "alma.complete", request, retry_policy=retry, **run.activity_options()
    )


def describe_failure(exc: BaseException) -> str:
    """A workflow's failure, cause after cause (an ActivityError says little alone)."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__
    return " <- ".join(parts)[:4000]


# --- the interceptor ---------------------------------------------------------------------


class AlmaWorkflowInbound(WorkflowInboundInterceptor):
    """Makes the run's ALMA context current for the workflow and its handlers, and
    finishes the ALMA run when the workflow returns or fails."""

    settings = WorkflowSettings()  # the plugin makes a subclass with its settings

    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        info = outbound.info()
        self.run = _Run(
            settings=self.settings,
            base=NodeHeader(
                tenant_id=_tenant(self.settings, info),
                workflow_id=info.workflow_type,
                run_id=mapping.run_id(info.workflow_id, info.run_id),
                workflow_version=_memo(mapping.MEMO_VERSION) or self.settings.workflow_version,
            ),
            namespace=info.namespace,
            workflow_id=info.workflow_id,
            temporal_run_id=info.run_id,
            task=_memo(mapping.MEMO_TASK),
        )
        super().init(AlmaWorkflowOutbound(outbound, self.run))

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        _RUN.set(self.run)
        try:
            result = await super().execute_workflow(input)
        except FailureError as exc:  # the workflow fails (other errors retry its task)
            if self.settings.complete_runs:
                await _complete(self.run, success=False, error_message=describe_failure(exc))
            raise
        if self.settings.complete_runs:
            await _complete(self.run)
        return result

    async def handle_signal(self, input: HandleSignalInput) -> None:
        _RUN.set(self.run)
        await super().handle_signal(input)

    async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
        _RUN.set(self.run)
        return await super().handle_update_handler(input)


class AlmaWorkflowOutbound(WorkflowOutboundInterceptor):
    """Puts the run's ALMA context on every activity it starts and keeps count of the
    workflow's own nodes (ALMA's activities are not nodes)."""

    def __init__(self, next: WorkflowOutboundInterceptor, run: _Run) -> None:
        super().__init__(next)
        self.run = run

    def _with_header(self, input: StartActivityInput | StartLocalActivityInput) -> str | None:
        options = _NODE.get() or NodeOptions()
        header = self.run.header(options)
        payload = workflow.payload_converter().to_payload(header.to_doc())
        input.headers = {**input.headers, mapping.HEADER: payload}
        if input.activity.startswith(mapping.INTERNAL_PREFIX):
            return None
        return options.node_id or input.activity

    def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
        node_id = self._with_header(input)
        handle = super().start_activity(input)
        if node_id is not None:
            self.run.track(node_id, handle)
        return handle

    def start_local_activity(self, input: StartLocalActivityInput) -> workflow.ActivityHandle[Any]:
        node_id = self._with_header(input)
        handle = super().start_local_activity(input)
        if node_id is not None:
            self.run.track(node_id, handle)
        return handle


def _memo(key: str) -> str | None:
    value = workflow.memo_value(key, None)
    return str(value) if value is not None else None


def _tenant(settings: WorkflowSettings, info: workflow.Info) -> str:
    memo = _memo(mapping.MEMO_TENANT)
    if memo:
        return memo
    if callable(settings.tenant_id):
        return settings.tenant_id(info)
    return settings.tenant_id or info.namespace
