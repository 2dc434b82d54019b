"""The worker side: :class:`AlmaPlugin` for a Temporal worker. It installs

* an activity interceptor that turns every activity of a workflow into node events of
  the workflow's ALMA run: ``node.started`` per attempt, then ``node.completed`` with
  the result (as ``updates`` or ``state``) or ``node.failed`` with the error and the
  attempt; with ``durable`` (the default) an activity returns only once its checkpoint
  is durable, and an event ALMA rejects fails the activity with a non-retryable
  ``ApplicationError`` that names the reason;
* the workflow interceptor of :mod:`~alma_core.integrations.temporal.workflow`;
* ALMA's activities ``alma.join``, ``alma.complete`` and ``alma.resume``;
* the sandbox passthrough of ``alma_core`` and ``schemas`` (the workflow side and the
  interceptor must share one copy of the module).

    client = await Client.connect("localhost:7233")
    worker = Worker(client, task_queue="review", workflows=[DocumentReview],
                    activities=[review, legal, finance],
                    plugins=[AlmaPlugin(alma_core.settings.load(), tenant_id="acme")])

Inside an activity, :func:`retrieve` asks ALMA what it learned, with the run's
context filled in.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.exceptions import ApplicationError
from temporalio.plugin import SimplePlugin
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowRunner,
)
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from alma_core import errors
from alma_core.integrations.temporal import mapping
from alma_core.integrations.temporal.mapping import (
    CompleteRequest,
    Head,
    JoinRequest,
    NodeHeader,
    ResumePoint,
    ResumeRequest,
)
from alma_core.integrations.temporal.workflow import AlmaWorkflowInbound, WorkflowSettings
from alma_core.memory import MemorySlice
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import RetrievalScope, WorkflowContext

log = logging.getLogger("alma.temporal")

PASSTHROUGH = ("alma_core",)


@dataclass(frozen=True)
class NodeContext:
    """The ALMA context of the activity running now (see :func:`current`)."""

    client: AlmaClient
    context: WorkflowContext


_NODE: contextvars.ContextVar[NodeContext | None] = contextvars.ContextVar(
    "alma_activity", default=None
)


def current() -> NodeContext:
    """The running activity's ALMA client and context (tenant, workflow, run, node)."""
    node = _NODE.get()
    if node is None:
        raise errors.ConfigError(
            "no ALMA context here: call this inside an activity of a worker with AlmaPlugin"
        )
    return node


async def retrieve(
    task: str,
    scope: RetrievalScope = RetrievalScope.WORKFLOW,
    *,
    workflow: str | None = None,
    agent: str | None = None,
    top_k: int = 5,
) -> MemorySlice:
    """What ALMA learned that is relevant to ``task``, within ``scope`` of the running
    activity's run (its tenant and workflow, its run and node for narrower scopes).
    ``workflow`` looks at another workflow type's memories of the same tenant."""
    node = current()
    ctx = node.context
    if workflow is not None and workflow != ctx.workflow_id:
        ctx = WorkflowContext(tenant_id=ctx.tenant_id, workflow_id=workflow)
    return await node.client.retrieve(task, ctx, scope, agent=agent, top_k=top_k)


def _fail(exc: errors.AlmaError, *, retry: bool = False) -> ApplicationError:
    """An ALMA error as the ApplicationError Temporal shows the workflow."""
    return ApplicationError(  # its str() is "Type: message": the type is not repeated
        exc.message, type=type(exc).__name__, non_retryable=not retry
    )


class _Nodes:
    """Publishes one activity's node events (the interceptor's side effects)."""

    def __init__(self, plugin: AlmaPlugin) -> None:
        self.plugin = plugin

    async def run(
        self, info: activity.Info, header: NodeHeader, call: Callable[[], Awaitable[Any]]
    ) -> Any:
        client = self.plugin.client
        node_id = header.node_id or info.activity_type
        ctx = header.context(node_id)
        ids = functools.partial(
            mapping.event_id,
            info.workflow_namespace or info.namespace,
            info.workflow_id or "",
            info.workflow_run_id or "",
            info.activity_id,
        )
        if self.plugin.record_starts:
            await self._publish(
                client.node_started(
                    ctx, attempt=info.attempt, event_id=ids("started", info.attempt)
                )
            )
        try:
            result = await call()
        except BaseException as exc:  # the attempt failed, was cancelled or timed out
            await self._failed(ctx, info, ids("failed", info.attempt), exc)
            raise
        try:
            value = (
                None
                if header.result == "ignore"
                else mapping.as_json(result, node_id, activity.payload_converter())
            )
            payload = mapping.node_payload(value, header, node_id)
            self._check_size(payload, node_id)
            completion = ids("completed")
            await self._publish(
                client.node_completed(
                    ctx,
                    **(payload or {"updates": {}}),
                    event_id=completion,
                    metadata={
                        "temporal": {"activity_id": info.activity_id, "attempt": info.attempt}
                    },
                    wait="applied" if self.plugin.durable else "published",
                    timeout=self.plugin.effect_timeout,
                )
            )
        except errors.EffectTimeout as exc:
            log.warning(  # in Kafka, not yet applied: the checkpoint comes later
                "the node's checkpoint was not confirmed in time; the activity completes",
                extra={
                    "action": "temporal_effect_timeout",
                    "run_id": ctx.run_id,
                    "node_id": node_id,
                    "error": exc.message,
                },
            )
        except (mapping.ResultNotJson, errors.RejectedEvent) as exc:
            await self._failed(ctx, info, ids("failed", info.attempt), exc)
            raise _fail(exc) from None
        return result

    def _check_size(self, payload: dict[str, Any] | None, node_id: str) -> None:
        """A state over the limit is refused before it is published."""
        if not payload:
            return
        size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
        limit = self.plugin.client.settings.max_state_bytes
        if size > limit:
            raise errors.StateTooLarge(
                f"activity {node_id!r} returned {size} bytes of state; the limit is {limit} "
                "(ALMA_MAX_STATE_BYTES): keep large data in artifacts, or pass fields= or "
                "result='ignore'"
            )

    async def _publish(self, publishing: Awaitable[str]) -> str:
        try:
            return await publishing
        except KafkaError as exc:
            raise ApplicationError(
                f"Kafka did not take the node's event ({exc!r}); Temporal retries the "
                "activity, and its events keep their ids",
                type="AlmaUnavailable",
            ) from exc

    async def _failed(
        self, ctx: WorkflowContext, info: activity.Info, event_id: str, exc: BaseException
    ) -> None:
        """Record the failed attempt; never hide the activity's own error."""
        error_type = exc.type if isinstance(exc, ApplicationError) and exc.type else None
        try:
            await self.plugin.client.node_failed(
                ctx,
                error_type=error_type or type(exc).__name__,
                message=str(exc)[:60_000],
                attempt=info.attempt,
                event_id=event_id,
            )
        except (KafkaError, errors.AlmaError) as publish_error:
            log.warning(
                "the node's failure could not be published",
                extra={
                    "action": "temporal_failure_unpublished",
                    "run_id": ctx.run_id,
                    "node_id": ctx.node_id,
                    "error": repr(publish_error),
                },
            )


class _ActivityInbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, plugin: AlmaPlugin) -> None:
        super().__init__(next)
        self.plugin = plugin

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        header = self.plugin.header(info, input.headers)
        if header is None:  # not part of a workflow (a standalone activity)
            return await self.next.execute_activity(input)
        node_id = header.node_id or info.activity_type
        token = _NODE.set(NodeContext(self.plugin.client, header.context(node_id)))
        try:
            if info.activity_type.startswith(mapping.INTERNAL_PREFIX):
                return await self.next.execute_activity(input)
            return await self.plugin.nodes.run(
                info, header, lambda: self.next.execute_activity(input)
            )
        finally:
            _NODE.reset(token)


class _Interceptor(Interceptor):
    def __init__(self, plugin: AlmaPlugin, inbound: type[WorkflowInboundInterceptor]) -> None:
        self.plugin = plugin
        self.inbound = inbound

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _ActivityInbound(next, self.plugin)

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        return self.inbound


class _Activities:
    """ALMA's own activities, run with the workflow's ALMA context."""

    def __init__(self, plugin: AlmaPlugin) -> None:
        self.plugin = plugin

    @activity.defn(name="alma.join")
    async def join(self, request: JoinRequest) -> dict[str, Any]:
        ctx = dataclasses.replace(current().context, node_id=request.node_id, branch_id=None)
        try:
            reply = await self.plugin.client.merge(
                ctx,
                branch_ids=request.branch_ids,
                states=request.states,
                reducers=request.reducers,
                default_reducer=request.default_reducer,
                strict=request.strict,
                join_id=request.join_id,
                timeout=request.timeout_s,
            )
        except errors.MergeTimeout as exc:
            raise _fail(exc, retry=True) from None  # the same join_id: answered once
        except (errors.MergeFailed, errors.ContextError) as exc:
            raise _fail(exc) from None
        return dict(reply.merged_state or {})

    @activity.defn(name="alma.complete")
    async def complete(self, request: CompleteRequest) -> None:
        info = activity.info()
        ctx = dataclasses.replace(current().context, node_id=None, branch_id=None)
        event_id = mapping.event_id(
            info.workflow_namespace or info.namespace,
            info.workflow_id or "",
            info.workflow_run_id or "",
            "run",
            "completed",
        )
        try:
            await self.plugin.client.workflow_completed(
                ctx,
                success=request.success,
                duration_ms=request.duration_ms,
                node_count=request.node_count,
                nodes_succeeded=request.nodes_succeeded,
                nodes_failed=request.nodes_failed,
                error_message=request.error_message,
                task=request.task,
                artifacts=request.artifacts,
                cleanup_checkpoints=request.cleanup_checkpoints,
                event_id=event_id,
            )
        except errors.ContextError as exc:
            raise _fail(exc) from None

    @activity.defn(name="alma.resume")
    async def resume(self, request: ResumeRequest) -> ResumePoint:
        info = activity.info()
        run = mapping.run_id(info.workflow_id or "", request.temporal_run_id)
        ctx = dataclasses.replace(current().context, run_id=run, node_id=None, branch_id=None)
        point = await self.plugin.client.resume(ctx)
        latest = point.latest
        return ResumePoint(
            run_id=run,
            seq=latest.seq if latest else 0,
            node_id=latest.node_id if latest else None,
            kind=latest.kind if latest else None,
            state=point.state,
            branches={
                b: Head(cp.seq, cp.node_id, cp.state)
                for b, cp in point.branch_heads.items()
                if b is not None
            },
        )


class AlmaPlugin(SimplePlugin):
    """ALMA Stream for a Temporal worker (see the module docstring).

    ``settings`` name the services (or pass a started ``client``); ``tenant_id`` is the
    tenant of every run (a name, or a deterministic function of the workflow's info;
    default: the memo ``alma.tenant_id``, else the namespace); ``durable``: activities
    return once their checkpoint is durable (False: once Kafka has the event);
    ``record_starts``: publish ``node.started`` per attempt; ``complete_runs``: finish
    the ALMA run when the workflow returns or fails; ``task_queue``: where ALMA's own
    activities run (default: the workflow's, and ``alma.complete`` then runs as a local
    activity); ``reducers``: per workflow type, the reducer of each state field its
    activities' ``updates`` fold with (registered for ``tenant_id`` when the worker
    starts, as ``alma reducers set`` would)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: AlmaClient | None = None,
        tenant_id: str | Callable[[Any], str] | None = None,
        workflow_version: str | None = None,
        durable: bool = True,
        record_starts: bool = True,
        complete_runs: bool = True,
        task_queue: str | None = None,
        effect_timeout: float = 30.0,
        reducers: dict[str, dict[str, str]] | None = None,
    ) -> None:
        if client is None and settings is None:
            raise errors.ConfigError("AlmaPlugin needs settings (alma_core.settings.load())")
        self.client = client or AlmaClient(settings)  # type: ignore[arg-type]
        self._owns_client = client is None
        self._running = 0
        if durable and not self.client.settings.postgres_dsn:
            raise errors.ConfigError(
                "AlmaPlugin(durable=True) confirms each checkpoint in PostgreSQL: set "
                "ALMA_POSTGRES_DSN (and ALMA_REDIS_URL), or pass durable=False"
            )
        self.default_tenant = tenant_id if isinstance(tenant_id, str) else None
        if reducers and self.default_tenant is None:
            raise errors.ConfigError(
                "AlmaPlugin(reducers=...) registers them for one tenant: give tenant_id as a "
                "name, or register each tenant's with `alma reducers set`"
            )
        self.reducers = reducers or {}
        self.durable = durable
        self.record_starts = record_starts
        self.effect_timeout = effect_timeout
        self.nodes = _Nodes(self)
        inbound = type(
            "AlmaWorkflowInbound",
            (AlmaWorkflowInbound,),
            {"settings": WorkflowSettings(tenant_id, workflow_version, complete_runs, task_queue)},
        )
        own = _Activities(self)
        super().__init__(
            "alma-stream",
            interceptors=[_Interceptor(self, inbound)],
            activities=[own.join, own.complete, own.resume],
            workflow_runner=_passthrough,
            run_context=self._run_context,
        )

    def header(self, info: activity.Info, headers: dict[str, Payload] | Any) -> NodeHeader | None:
        """The activity's ALMA context: from the workflow's header, else (a workflow on a
        worker without the plugin) from the activity's info alone."""
        if not info.workflow_id or not info.workflow_run_id:
            return None
        payload = headers.get(mapping.HEADER) if headers else None
        if payload is not None:
            doc = activity.payload_converter().from_payload(payload, dict)
            return NodeHeader.from_doc(doc)
        return NodeHeader(
            tenant_id=self.default_tenant or info.workflow_namespace or info.namespace,
            workflow_id=info.workflow_type or info.activity_type,
            run_id=mapping.run_id(info.workflow_id, info.workflow_run_id),
        )

    @contextlib.asynccontextmanager
    async def _run_context(self) -> AsyncIterator[None]:
        """The client runs while a worker with this plugin runs (once for several)."""
        if self._owns_client and self._running == 0:
            await self.client.start()  # closes what it opened if it fails
        if self._running == 0:
            try:
                for workflow_type, fields in self.reducers.items():
                    ctx = WorkflowContext(tenant_id=self.default_tenant, workflow_id=workflow_type)
                    await self.client.register_reducers(ctx, fields)
            except BaseException:  # the worker does not start: nothing of ours stays open
                if self._owns_client:
                    await self.client.stop()
                raise
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._owns_client and self._running == 0:
                await self.client.stop()


def _passthrough(runner: WorkflowRunner | None) -> WorkflowRunner:
    """The sandbox shares ``alma_core`` and ``schemas`` with the worker (the workflow
    side and the interceptor must see the same context variables)."""
    if runner is None:
        runner = SandboxedWorkflowRunner()
    if isinstance(runner, SandboxedWorkflowRunner):
        return dataclasses.replace(
            runner, restrictions=runner.restrictions.with_passthrough_modules(*PASSTHROUGH)
        )
    return runner
