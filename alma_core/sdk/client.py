"""AlmaClient: the orchestrator's side. Publishes lifecycle events (key = run_id,
acks from all in-sync replicas), awaits merge replies, and finds where a run
resumes after a crash (PostgreSQL's heads, their states from Redis where cached).

Merge replies come through one :class:`~alma_core.sdk.replies.ReplyListener` per
client. A join sent again with the same ``join_id`` gets the same reply (the
joiner remembers it), so retrying after a timeout is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal, overload

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from alma_core import errors
from alma_core import settings as settings_mod
from alma_core.logs import redact
from alma_core.memory import MemorySlice
from alma_core.messaging import kafka
from alma_core.sdk.replies import ReplyListener
from alma_core.settings import Settings
from alma_core.storage import effects, reducer_configs, runs
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.effects import EffectListener
from alma_core.storage.embeddings import TextEmbedder, embedder_for
from alma_core.storage.graphs import GraphReader
from alma_core.storage.inflight import InFlight
from alma_core.storage.migrations import Migrator
from alma_core.storage.observer import ReadMetrics, ReadObserver
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from alma_core.storage.retrieval import Retriever
from alma_core.types import Checkpoint, RetrievalScope, WorkflowContext
from schemas.events import EVENT_MODELS, Event, EventType, MergeReply, encode


@dataclass(frozen=True)
class ResumePoint:
    """A run's resume point. ``latest`` None: the run has no checkpoint, so it starts
    over with an empty state, whether ALMA has seen events of it (``status`` says
    which, e.g. a run with only a ``node.started``) or not (``status`` None)."""

    run_id: str
    latest: Checkpoint | None
    branch_heads: dict[str | None, Checkpoint]
    status: str | None = None  # running, succeeded, failed; None: no event of it applied

    @property
    def state(self) -> dict[str, Any]:
        """The main line's state to continue from (empty for a new run)."""
        main = self.branch_heads.get(None)
        return dict(main.state) if main else {}


@dataclass(frozen=True)
class Applied:
    """What the checkpointer did with one event: ``checkpointed`` (at ``seq``),
    ``unchanged`` (same state as the head at ``seq``), ``recorded`` or ``handed_off``."""

    event_id: str
    effect: str
    seq: int | None


Wait = Literal["published", "applied"]
"""How long a publish waits: until the broker has the event (``published``), or until
the checkpointer has had its effect too (``applied``: read-your-writes)."""

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
        self.bootstrap = bootstrap or settings.kafka_bootstrap
        if not self.bootstrap:
            raise errors.ConfigError(no_bootstrap(settings))
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise errors.ConfigError(
                "AlmaClient is built inside the event loop that uses it (async with "
                "AlmaClient(...)); from synchronous code, use asyncio.run(...), or for "
                "LangGraph's graph.invoke, AlmaSaver.from_settings_sync(...)"
            ) from None
        options = kafka.client_options(settings)
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            **options,
            acks="all",
            linger_ms=1,
            max_request_size=settings.max_record_bytes + 64 * 1024,
        )
        self._replies = ReplyListener(
            self.bootstrap,
            settings.merged_topic,
            fetch_max_wait_ms=settings.fetch_max_wait_ms,
            client_options=options,
        )
        self._reads: contextlib.AsyncExitStack | None = None
        self._opening = asyncio.Lock()  # concurrent first reads open one pool, not several
        self._pool: asyncpg.Pool | None = None
        self._cache: RedisCheckpointCache | None = None
        self._effects: EffectListener | None = None
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
        """Connect the producer; one that cannot is closed again (nothing left open) and
        the error says where it dialled and what to do."""
        try:
            await self._producer.start()
        except BaseException as exc:
            await self._producer.stop()
            if isinstance(exc, KafkaError):
                raise errors.BrokerUnavailable(
                    f"AlmaClient cannot reach Kafka at {redact(self.bootstrap or '')}: {exc!r}. "
                    "What to do: check ALMA_KAFKA_BOOTSTRAP and that the broker runs, or "
                    "start `alma up` and build the client from load_running()"
                ) from exc
            raise

    async def stop(self) -> None:
        await self._replies.stop()
        await self._producer.stop()
        if self._effects is not None:
            await self._effects.close()
        if self._reads is not None:
            await self._reads.aclose()
        if self._own_embedder and self._embedder is not None:
            self._embedder.close()

    async def reader(self, tenant_id: str) -> CheckpointReader:
        """The tenant's reads of checkpoints (opened on first use): never older than
        PostgreSQL, scoped to the tenant."""
        pool = await self._open_reads()
        return CheckpointReader(
            pool,
            self._cache,
            tenant_id=tenant_id,
            require_tenant=self.settings.require_tenant,
            observer=self.observer,
        )

    async def graph_reader(self, tenant_id: str, workflow_id: str | None) -> GraphReader:
        """The tenant's reads of LangGraph threads (opened on first use), of the graph
        ``workflow_id`` (:class:`~alma_core.storage.graphs.GraphReader`)."""
        return GraphReader(await self._open_reads(), tenant_id, workflow_id)

    async def upgrade_schema(self) -> None:
        """Bring ALMA's schema to the version this code needs (what `alma up` and
        `alma db upgrade` apply; nothing when it is there already)."""
        pool = await self._open_reads()
        async with pool.acquire() as conn:
            await Migrator(conn).migrate()

    async def read_pool(self) -> asyncpg.Pool:
        """The client's PostgreSQL pool for reads (opened on first use), for ALMA's own
        tools that query across tables with the tenant in each query (the inspector)."""
        return await self._open_reads()

    async def in_flight(self) -> InFlight:
        """The marks of writes published and not yet seen applied (Redis), by which
        ``wait="published"`` writers tell readers in other processes to wait for them."""
        await self._open_reads()
        assert self._cache is not None
        return InFlight(self._cache)

    async def _open_reads(self) -> asyncpg.Pool:
        async with self._opening:
            if self._reads is None:
                if not (self.settings.postgres_dsn and self.settings.redis_url):
                    raise errors.ConfigError(
                        "reads (resume, applied, retrieve) need ALMA_POSTGRES_DSN and "
                        "ALMA_REDIS_URL (the services of `alma up` are in .alma/endpoints.json)"
                    )
                stack = contextlib.AsyncExitStack()
                self._pool = await stack.enter_async_context(
                    connect(self.settings.postgres_dsn, max_size=4)
                )
                self._cache = await stack.enter_async_context(
                    RedisCheckpointCache.for_settings(self.settings)
                )
                self._reads = stack
        assert self._pool is not None
        return self._pool

    async def applied(
        self,
        ctx: WorkflowContext,
        event_id: str,
        *,
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> Applied:
        """Wait until the checkpointer has had ``event_id``'s effect (read-your-writes).
        Raises the event's rejection (e.g. StaleExpectedSeq) if it was dead-lettered,
        and EffectTimeout if neither happened in ``timeout`` seconds."""
        if not (ctx.tenant_id and ctx.run_id):
            raise errors.ContextError("applied() needs the run's tenant_id and run_id")
        pool = await self._open_reads()
        listener = await self._effect_listener()
        deadline = time.monotonic() + timeout
        pause = 0.005
        # watching before the first read: a commit in between still wakes it
        watching = (
            listener.watch(ctx.tenant_id, ctx.run_id, event_id)
            if listener is not None
            else contextlib.nullcontext((None, False))
        )
        async with watching as (woke, early):
            # watched since before its publish (publish() expected it): its commit cannot
            # have been missed, so the first read waits for the notification
            read = not early
            while True:
                if read:
                    if woke is not None:
                        woke.clear()  # before the read: a commit during it wakes the wait
                    found = await runs.effect_of(pool, event_id, ctx.tenant_id, ctx.run_id)
                    if found is not None and found.rejected is not None:
                        reason, detail = found.rejected
                        raise errors.rejection(reason, f"event {event_id}: {detail}")
                    if found is not None:
                        return Applied(event_id, found.effect or "", found.checkpoint_seq)
                read = True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.EffectTimeout(
                        f"event {event_id} of run {ctx.run_id!r} had no effect within "
                        f"{timeout:g} s. It is published and may still take effect, once a "
                        "checkpointer applies it: call applied() again with this event id to "
                        "know (never publish it again under a new id). Check that the "
                        "checkpointer runs (`alma up`) and is not lagging (alma_consumer_lag "
                        "on /metrics)"
                    )
                if woke is not None and listener is not None and listener.alive:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woke.wait(), min(left, effects.POLL_S))
                else:  # no notifications: poll on a back-off
                    await asyncio.sleep(min(left, pause))
                    pause = min(0.1, pause * 2)

    async def _effect_listener(self) -> EffectListener | None:
        """The client's LISTEN connection for effects (opened on first use, reopened
        when lost); None when it cannot be opened (``applied`` then polls)."""
        if not self.settings.notify_effects:
            return None  # the workers do not notify: poll
        async with self._opening:
            if self._effects is not None and self._effects.alive:
                return self._effects
            if self._effects is not None:
                await self._effects.close()
                self._effects = None
            try:
                assert self.settings.postgres_dsn is not None  # _open_reads checked it
                self._effects = await EffectListener.open(self.settings.postgres_dsn)
            except (OSError, asyncpg.PostgresError) as exc:
                log.warning(
                    "cannot listen for effects (%s); applied() polls PostgreSQL instead",
                    redact(str(exc)),
                )
            return self._effects

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
        pool = await self._open_reads()
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
            await self._open_reads(), ctx.tenant_id, ctx.workflow_id, fields
        )

    async def resume(self, ctx: WorkflowContext) -> ResumePoint:
        """Where a run picks up after a crash: its latest checkpoint and branch heads."""
        ctx.validate(require_tenant=True)
        if not (ctx.tenant_id and ctx.run_id):
            raise errors.ContextError("resume needs tenant_id and run_id")
        reader = await self.reader(ctx.tenant_id)
        heads = await reader.branch_heads(ctx.run_id)  # the latest is one of them
        latest = max(heads.values(), key=lambda cp: cp.seq) if heads else None
        return ResumePoint(ctx.run_id, latest, heads, await reader.status(ctx.run_id))

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
        record = encode(event)
        if len(record) > self.settings.max_record_bytes:
            raise errors.RecordTooLarge(
                f"{event.type} {event.event_id} of run {event.run_id!r} is {len(record):,} "
                f"bytes, over ALMA_MAX_RECORD_BYTES={self.settings.max_record_bytes:,}: keep "
                "large values out of the state (an artifact reference), or raise the limit "
                "on the broker's topic and in ALMA_MAX_RECORD_BYTES alike"
            )
        if wait == "applied" and self._reads is not None:
            await self._effect_listener()  # (re)opened before the send: no first read
        # watch the run from before the send, so applied() needs no read before its wait
        # (only on a listener already open: a client that never waits opens none)
        listener = self._effects if self._effects is not None and self._effects.alive else None
        if listener is not None and event.tenant_id:
            listener.expect(event.event_id, event.tenant_id, event.run_id)
        try:
            await self._producer.send_and_wait(
                self.settings.lifecycle_topic, record, key=event.run_id.encode()
            )
        except BaseException:
            if listener is not None:
                listener.forget(event.event_id)
            raise
        if wait == "published":
            return event.event_id
        ctx = WorkflowContext(event.tenant_id, event.workflow_id, None, event.run_id)
        return await self.applied(ctx, event.event_id, timeout=timeout)

    async def publish_record(self, value: bytes, key: bytes | None) -> None:
        """Send one record to the lifecycle topic as it is (a dead letter sent back:
        :func:`alma_core.sdk.dead_letters.replay`); it is decoded like any other."""
        await self._producer.send_and_wait(self.settings.lifecycle_topic, value, key=key)

    def event(
        self,
        type_: str,
        ctx: WorkflowContext,
        payload: dict[str, Any],
        *,
        event_id: str | None = None,
    ) -> Event:
        """A contract event for ``ctx``, checked before anything is sent (a bad context or
        payload raises ContextError). ``event_id`` makes it idempotent: an orchestrator
        that derives it from its own identity of the step (Temporal's activity id, say)
        can publish again after a crash and the event has its effect once."""
        ctx.validate(require_tenant=self.settings.require_tenant)
        if not (ctx.tenant_id and ctx.workflow_id and ctx.run_id):
            raise errors.ContextError(f"{type_} needs tenant_id, workflow_id and run_id")
        if type_.startswith("node.") and not ctx.node_id:
            raise errors.ContextError(f"{type_} needs node_id")
        doc = {
            "event_id": event_id or uuid.uuid4().hex,
            "type": type_,
            "emitted_at": datetime.now(UTC),
            "tenant_id": ctx.tenant_id,
            "workflow_id": ctx.workflow_id,
            "workflow_version": ctx.workflow_version,
            "run_id": ctx.run_id,
            "node_id": ctx.node_id,
            "branch_id": ctx.branch_id,
            "payload": {k: v for k, v in payload.items() if v is not None},
        }
        try:
            return EVENT_MODELS[EventType(type_)].model_validate(doc, strict=False)  # type: ignore[return-value]
        except ValidationError as exc:
            raise errors.ContextError(f"invalid {type_}: {exc.errors()[0]['msg']}") from None

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
        """Publish a finished run's outcome (for the learner); see :func:`outcome`."""
        payload = outcome(
            success=success,
            duration_ms=duration_ms,
            node_count=node_count,
            nodes_succeeded=nodes_succeeded,
            nodes_failed=nodes_failed,
            error_message=error_message,
            task=task,
            artifacts=artifacts,
            cleanup_checkpoints=cleanup_checkpoints,
        )
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
        future = await self._replies.expect(key)
        try:
            await self.publish(event)
            reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise errors.MergeTimeout(
                f"no reply to join {join_id!r} of run {ctx.run_id!r} within {timeout:.0f} s; "
                "check that the checkpointer and joiner run (`alma up`), then retry with the "
                "same join_id"
            ) from None
        finally:
            self._replies.forget(key)
        if reply.status == "error":
            raise errors.MergeFailed(f"join {join_id!r} of run {ctx.run_id!r}: {reply.error}")
        return reply


def outcome(
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
) -> dict[str, Any]:
    """A ``workflow.completed`` payload (for :meth:`AlmaClient.event`)."""
    return {
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


def no_bootstrap(s: Settings) -> str:
    """Why a client has no broker, and what to do: use the running ``alma up`` (found
    from any directory) through ``load_running()``, or start one, or set the variable."""
    what = "AlmaClient needs a Kafka bootstrap (ALMA_KAFKA_BOOTSTRAP, or bootstrap=...)"
    try:
        stack = settings_mod.running(s)
    except errors.ConfigError as several:
        return f"{what}; {several.message}"
    if stack is not None:
        return (
            f"{what}: an `alma up` is running on {stack.data_dir}. What to do: build the "
            "client from load_running() (alma_core.settings), which takes its services"
        )
    return (
        f"{what} and no `alma up` is running ({settings_mod.search(s).described()}). What "
        "to do: start the embedded stack with `alma up` (in any directory) and build the "
        "client from load_running(), or set ALMA_KAFKA_BOOTSTRAP"
    )
