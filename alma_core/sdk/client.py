"""AlmaClient: the orchestrator's side, the sum of parts each usable alone: a
:class:`~alma_core.sdk.publisher.Publisher` (lifecycle events, acks from all in-sync
replicas), an :class:`~alma_core.sdk.waiter.EffectWaiter` (until an event is applied),
the merge :class:`~alma_core.sdk.replies.ReplyListener`, and the reads
(:class:`~alma_core.sdk.reads.ReadConnections`: where a run resumes after a crash from
PostgreSQL's heads, their states from Redis where cached; retrieval).

A join sent again with the same ``join_id`` gets the same reply (the joiner remembers
it), so retrying after a timeout is safe.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal, overload

import asyncpg

from alma_core import errors, tracing
from alma_core.memory import MemorySlice
from alma_core.messaging import acls, kafka
from alma_core.schemas.events import Event, MergeReply
from alma_core.sdk.publisher import Publisher, Wait
from alma_core.sdk.reads import ReadConnections
from alma_core.sdk.replies import ReplyListener
from alma_core.sdk.waiter import Applied, EffectWaiter
from alma_core.settings import Settings
from alma_core.storage import reducer_configs
from alma_core.storage import tenant_settings as tenants
from alma_core.storage.embeddings import TextEmbedder, embedder_for
from alma_core.storage.graphs import GraphReader
from alma_core.storage.inflight import InFlight
from alma_core.storage.migrations import Migrator
from alma_core.storage.observer import ReadMetrics, ReadObserver
from alma_core.storage.reader import CheckpointReader
from alma_core.storage.retrieval import Retriever
from alma_core.types import BlockingLetter, Checkpoint, RetrievalScope, WorkflowContext


@dataclass(frozen=True)
class ResumePoint:
    """A run's resume point. ``latest`` None: the run has no checkpoint, so it starts
    over with an empty state, whether ALMA has seen events of it (``status`` says
    which, e.g. a run with only a ``node.started``) or not (``status`` None)."""

    run_id: str
    latest: Checkpoint | None
    branch_heads: dict[str | None, Checkpoint]
    status: str | None = None  # running, succeeded, failed; None: no event of it applied
    # a running run waiting on dead letters of its own events (docs/guarantees.md §11):
    # resuming it repeats what was refused unless what refused it is fixed first
    blocked_by: tuple[BlockingLetter, ...] = ()

    @property
    def blocked(self) -> bool:
        """Whether the run waits on a dead letter of its own (see ``blocked_by``)."""
        return bool(self.blocked_by)

    @property
    def state(self) -> dict[str, Any]:
        """The main line's state to continue from (empty for a new run)."""
        main = self.branch_heads.get(None)
        return dict(main.state) if main else {}


log = logging.getLogger("alma.sdk")


def _fallback(why: str) -> None:
    log.warning(why, extra={"action": "embed_fallback"})


class AlmaClient:
    """The orchestrator's handle on ALMA Stream: publish lifecycle events, merge
    branches, wait for an event's effect, resume a run, and retrieve memories.

    ``embedder`` serves :meth:`retrieve` (default: the model the settings name,
    loaded on first use); ``observer`` hears of every cache lookup and retrieval
    (default: :meth:`ReadMetrics.shared`, this process's Prometheus registry)."""

    def __init__(
        self,
        settings: Settings,
        *,
        bootstrap: str | None = None,
        embedder: TextEmbedder | None = None,
        observer: ReadObserver | None = None,
    ) -> None:
        self.settings = settings
        self.publisher = Publisher(settings, bootstrap=bootstrap)
        self.bootstrap = self.publisher.bootstrap
        self.reads = ReadConnections(settings)
        self.waiter = EffectWaiter(self.reads)
        # a contract event for a context, checked before anything is sent
        self.event = self.publisher.event
        # wait until the checkpointer has had an event's effect (read-your-writes): its
        # Applied, its rejection raised if it was dead-lettered, EffectTimeout if neither
        self.applied = self.waiter.applied
        # one listener per reply topic (ALMA_TENANT_TOPICS: per tenant), each started by
        # the first merge that waits on it
        self._replies: dict[str, ReplyListener] = {}
        self._embedder = embedder
        self._own_embedder = False
        self._retriever: Retriever | None = None
        self.observer = observer or ReadMetrics.shared()

    async def __aenter__(self) -> AlmaClient:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect the publisher (:meth:`Publisher.start`: nothing left open if it
        cannot, and the error says what to do)."""
        await self.publisher.start()

    async def stop(self) -> None:
        for listener in self._replies.values():
            await listener.stop()
        await self.publisher.stop()
        await self.waiter.close()
        await self.reads.close()
        if self._own_embedder and self._embedder is not None:
            self._embedder.close()

    # -- reads ------------------------------------------------------------------------

    async def reader(self, tenant_id: str) -> CheckpointReader:
        """The tenant's reads of checkpoints (opened on first use): never older than
        PostgreSQL, scoped to the tenant."""
        return CheckpointReader(
            await self.reads.pool(),
            await self.reads.cache(),
            tenant_id=tenant_id,
            require_tenant=self.settings.require_tenant,
            observer=self.observer,
        )

    async def graph_reader(self, tenant_id: str, workflow_id: str | None) -> GraphReader:
        """The tenant's reads of LangGraph threads (opened on first use), of the graph
        ``workflow_id`` (:class:`~alma_core.storage.graphs.GraphReader`)."""
        return GraphReader(await self.reads.pool(), tenant_id, workflow_id)

    async def upgrade_schema(self) -> None:
        """Bring ALMA's schema to the version this code needs (what `alma up` and
        `alma db upgrade` apply; nothing when it is there already)."""
        pool = await self.reads.pool()
        async with pool.acquire() as conn:
            await Migrator(conn).migrate()

    async def read_pool(self) -> asyncpg.Pool:
        """The client's PostgreSQL pool for reads (opened on first use), for ALMA's own
        tools that query across tables with the tenant in each query (the inspector)."""
        return await self.reads.pool()

    async def in_flight(self) -> InFlight:
        """The marks of writes published and not yet seen applied (Redis), by which
        ``wait="published"`` writers tell readers in other processes to wait for them."""
        return InFlight(await self.reads.cache())

    async def retrieve(
        self,
        task: str,
        ctx: WorkflowContext,
        scope: RetrievalScope = RetrievalScope.WORKFLOW,
        *,
        agent: str | None = None,
        top_k: int = 5,
        include_workflow_outcomes: bool = True,
    ) -> MemorySlice:
        """What ALMA Stream knows about ``task`` within ``scope`` of ``ctx``
        (:class:`~alma_core.storage.retrieval.Retriever`)."""
        pool = await self.reads.pool()
        if self._embedder is None:
            # a worker's model when ALMA_EMBED_URL names one, else loaded here (seconds)
            self._embedder = await asyncio.to_thread(embedder_for, self.settings, _fallback)
            self._own_embedder = True
        if self._retriever is None:  # one for the client: it keeps the scopes' plans
            self._retriever = Retriever.configured(
                pool, self._embedder, self.settings, self.observer
            )
        return await self._retriever.retrieve(
            task,
            ctx,
            scope,
            agent=agent,
            top_k=top_k,
            include_workflow_outcomes=include_workflow_outcomes,
        )

    async def register_reducers(self, ctx: WorkflowContext, fields: dict[str, str]) -> None:
        """Add ``fields`` (field -> reducer name) to the reducers of ``ctx``'s workflow
        (:func:`alma_core.storage.reducer_configs.add_fields`)."""
        if not (ctx.tenant_id and ctx.workflow_id):
            raise errors.ContextError("register_reducers needs tenant_id and workflow_id")
        await reducer_configs.add_fields(
            await self.reads.pool(), ctx.tenant_id, ctx.workflow_id, fields
        )

    async def tenant_settings(self, tenant_id: str) -> tenants.TenantSettings:
        """``tenant_id``'s own settings (a None field: the global value), as `alma
        tenants show` reads them."""
        return await tenants.load(await self.reads.pool(), tenant_id)

    async def tenant_usage(self, tenant_id: str) -> tenants.TenantUsage:
        """What ``tenant_id`` holds in PostgreSQL now, as `alma tenants show` reports it
        (:func:`alma_core.storage.tenant_settings.usage`)."""
        return await tenants.usage(await self.reads.pool(), tenant_id)

    async def tenant_storage(self, tenant_id: str) -> tenants.StorageStanding:
        """``tenant_id``'s kept checkpoint bytes against its storage quota in effect (the
        count the checkpointer holds it to; ``full``: its new runs are refused)."""
        return await tenants.standing(
            await self.reads.pool(), tenant_id, self.settings.tenant_storage_quota_bytes
        )

    async def set_tenant_settings(
        self,
        tenant_id: str,
        *,
        rate_per_s: float | None = None,
        burst: int | None = None,
        learner: bool | None = None,
        checkpoint_retention_days: float | None = None,
        storage_quota_bytes: int | None = None,
        max_state_bytes: int | None = None,
    ) -> tenants.TenantSettings:
        """Set every one of ``tenant_id``'s own settings (None: the global value; all
        None: back to the global settings), as `alma tenants set` does. The workers
        apply them within ``tenants.REFRESH_S`` seconds, without a restart."""
        return await tenants.store(
            await self.reads.pool(),
            tenant_id,
            rate_per_s=rate_per_s,
            burst=burst,
            learner=learner,
            checkpoint_retention_days=checkpoint_retention_days,
            storage_quota_bytes=storage_quota_bytes,
            max_state_bytes=max_state_bytes,
        )

    async def resume(self, ctx: WorkflowContext) -> ResumePoint:
        """Where a run picks up after a crash: its latest checkpoint and branch heads."""
        ctx.validate(require_tenant=True)
        if not (ctx.tenant_id and ctx.run_id):
            raise errors.ContextError("resume needs tenant_id and run_id")
        reader = await self.reader(ctx.tenant_id)
        heads = await reader.branch_heads(ctx.run_id)  # the latest is one of them
        latest = max(heads.values(), key=lambda cp: cp.seq) if heads else None
        status = await reader.status(ctx.run_id)
        blocked = await reader.blocked_by(ctx.run_id) if status == "running" else []
        return ResumePoint(ctx.run_id, latest, heads, status, tuple(blocked))

    # -- writes -----------------------------------------------------------------------

    @overload
    async def publish(
        self,
        event: Event,
        *,
        wait: Literal["published"] = "published",
        timeout: float = 30.0,  # noqa: ASYNC109
    ) -> str: ...

    @overload
    async def publish(
        self,
        event: Event,
        *,
        wait: Literal["applied"],
        timeout: float = 30.0,  # noqa: ASYNC109
    ) -> Applied: ...

    async def publish(
        self,
        event: Event,
        *,
        wait: Wait = "published",
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> str | Applied:
        """Publish one contract event and wait for the broker's acknowledgement (so one
        caller's events of a run cannot overtake each other); returns its event_id.
        ``wait="applied"``: then wait until the checkpointer has had its effect and return
        it (:meth:`applied`: raises the event's rejection, or EffectTimeout)."""
        if wait == "applied" and self.reads.opened:
            await self.waiter.listen()  # (re)opened before the send: no first read
        # told of the event before the send, so a wait needs no first read (only a
        # listener already open: a client that never waits opens none)
        await self.publisher.send(event, watch=self.waiter.listening)
        if wait == "published":
            return event.event_id
        ctx = WorkflowContext(event.tenant_id, event.workflow_id, None, event.run_id)
        return await self.waiter.applied(ctx, event.event_id, timeout=timeout)

    async def publish_record(self, topic: str, value: bytes, key: bytes | None) -> None:
        """Send one record to a lifecycle topic as it is (:meth:`Publisher.send_record`)."""
        await self.publisher.send_record(topic, value, key)

    async def node_started(
        self,
        ctx: WorkflowContext,
        *,
        attempt: int | None = None,
        input: dict[str, Any] | None = None,
        event_id: str | None = None,
        wait: Wait = "published",
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> str:
        """Publish ``node.started``; ``wait`` and ``timeout`` as :meth:`publish` (the
        effect, when ``applied``, is raised if refused). Returns the event id, as each
        of these calls does; :meth:`publish` of :meth:`event` returns the effect too."""
        payload = {"attempt": attempt, "input": input}
        return await self._send("node.started", ctx, payload, event_id, wait, timeout)

    async def node_completed(
        self,
        ctx: WorkflowContext,
        *,
        state: dict[str, Any] | None = None,
        updates: dict[str, Any] | None = None,
        expected_seq: int | None = None,
        metadata: dict[str, Any] | None = None,
        event_id: str | None = None,
        wait: Wait = "published",
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> str:
        """A checkpoint: the full ``state``, or ``updates`` folded with the run's reducers."""
        payload = {
            "state": state,
            "updates": updates,
            "expected_seq": expected_seq,
            "metadata": metadata,
        }
        return await self._send("node.completed", ctx, payload, event_id, wait, timeout)

    async def node_failed(
        self,
        ctx: WorkflowContext,
        *,
        error_type: str,
        message: str,
        state: dict[str, Any] | None = None,
        updates: dict[str, Any] | None = None,
        attempt: int | None = None,
        event_id: str | None = None,
        wait: Wait = "published",
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> str:
        payload = {
            "error": {"type": error_type, "message": message},
            "attempt": attempt,
            "state": state,
            "updates": updates,
        }
        return await self._send("node.failed", ctx, payload, event_id, wait, timeout)

    async def workflow_completed(
        self,
        ctx: WorkflowContext,
        *,
        success: bool,
        duration_ms: int,
        node_count: int,
        nodes_succeeded: int,
        nodes_failed: int,
        error_message: str | None = None,
        task: str | None = None,
        artifacts: list[dict[str, Any]] | None = None,
        cleanup_checkpoints: bool | None = None,
        event_id: str | None = None,
        wait: Wait = "published",
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> str:
        """Publish a finished run's outcome, for the learner."""
        payload = {
            "outcome": "success" if success else "failure",
            "duration_ms": duration_ms,
            "node_count": node_count,
            "nodes_succeeded": nodes_succeeded,
            "nodes_failed": nodes_failed,
            "error_message": error_message,
            "task": task,
            "artifacts": artifacts,
            "cleanup_checkpoints": cleanup_checkpoints,
        }
        return await self._send("workflow.completed", ctx, payload, event_id, wait, timeout)

    async def _send(
        self,
        type_: str,
        ctx: WorkflowContext,
        payload: dict[str, Any],
        event_id: str | None,
        wait: Wait,
        timeout: float,  # noqa: ASYNC109 - passed on to publish
    ) -> str:
        event = self.event(type_, ctx, payload, event_id=event_id)
        if wait == "applied":
            await self.publish(event, wait="applied", timeout=timeout)
            return event.event_id
        return await self.publish(event)

    def _listener(self, topic: str) -> ReplyListener:
        listener = self._replies.get(topic)
        if listener is None:
            s = self.settings
            listener = self._replies[topic] = ReplyListener(
                self.bootstrap,
                topic,
                fetch_max_wait_ms=s.fetch_max_wait_ms,
                client_options=kafka.client_options(s),
                principal=acls.principal(s),
            )
        return listener

    async def merge(
        self,
        ctx: WorkflowContext,
        *,
        branch_ids: list[str] | None = None,
        states: list[dict[str, Any]] | None = None,
        reducers: dict[str, str] | None = None,
        default_reducer: str | None = None,
        strict: bool | None = None,
        join_id: str | None = None,
        node_id: str | None = None,
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> MergeReply:
        """Ask for a merge and await its reply. Raises MergeFailed on an error reply and
        MergeTimeout (naming the join) when none comes in ``timeout`` seconds."""
        join_id = join_id or uuid.uuid4().hex
        # A new event per attempt (the inbox would drop a repeated event_id); the joiner
        # recognises the join_id and answers a retry with the same reply.
        payload = {
            "join_id": join_id,
            "branch_ids": branch_ids,
            "states": states,
            "reducers": reducers,
            "default_reducer": default_reducer,
            "strict": strict,
        }
        event = self.event("branch.join", replace(ctx, node_id=node_id or ctx.node_id), payload)
        key = (ctx.tenant_id or "", ctx.run_id or "", join_id)
        replies = self._listener(self.settings.topic_names.replies_for(ctx.tenant_id or ""))
        future = await replies.expect(key)
        try:
            with tracing.caller_span(
                "merge", attributes={**tracing.event_attributes(event), "alma.join_id": join_id}
            ):
                await self.publish(event)
                reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise errors.MergeTimeout(
                f"no reply to join {join_id!r} of run {ctx.run_id!r} within {timeout:.0f} s; "
                "check that the checkpointer and joiner run (`alma up`), then retry with the "
                "same join_id"
            ) from None
        finally:
            replies.forget(key)
        if reply.status == "error":
            raise errors.MergeFailed(f"join {join_id!r} of run {ctx.run_id!r}: {reply.error}")
        return reply
