"""AlmaClient: the orchestrator's side. Publishes lifecycle events (key = run_id,
acks from all in-sync replicas) and awaits merge replies.

One reply listener per client reads the reply topic (every partition, from the
end as of start-up) and resolves the future of each ``join_id`` it is waiting
for; replies that are not its own are ignored, so several clients can share
one reply topic. A join sent again with the same ``join_id`` gets the same
reply (the joiner remembers it), so retrying after a timeout is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from pydantic import ValidationError

from alma_core import errors
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from schemas.events import BranchJoin, MergeReply, encode


class AlmaClient:
    def __init__(self, settings: Settings, *, bootstrap: str | None = None) -> None:
        self.settings = settings
        self.bootstrap = bootstrap or settings.kafka_bootstrap
        if not self.bootstrap:
            raise errors.ConfigError("AlmaClient needs ALMA_KAFKA_BOOTSTRAP (or bootstrap=...)")
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",
            linger_ms=1,
            max_request_size=settings.max_record_bytes + 64 * 1024,
        )
        self._replies: AIOKafkaConsumer | None = None
        self._listener: asyncio.Task[None] | None = None
        self._waiting: dict[str, asyncio.Future[MergeReply]] = {}
        self._listener_lock = asyncio.Lock()

    async def __aenter__(self) -> AlmaClient:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        if self._replies is not None:
            await self._replies.stop()
        await self._producer.stop()

    async def publish(self, event: BranchJoin | Any) -> None:
        """Publish one contract event and wait for the broker's acknowledgement (so one
        caller's events of a run cannot overtake each other)."""
        await self._producer.send_and_wait(
            self.settings.lifecycle_topic, encode(event), key=event.run_id.encode()
        )

    async def _ensure_listener(self) -> None:
        async with self._listener_lock:  # concurrent merges share one listener
            if self._listener is None:
                await self._start_listener()

    async def _start_listener(self) -> None:
        topic = self.settings.merged_topic
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=self.settings.fetch_max_wait_ms,
        )
        await consumer.start()
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await consumer.stop()
            raise errors.ConfigError(
                f"reply topic {topic!r} does not exist: run `alma topics create`"
            )
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:  # resolve positions now, before any join is sent
            await consumer.position(tp)
        self._replies = consumer
        self._listener = asyncio.create_task(self._listen(consumer))

    async def _listen(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    join_id = dict(record.headers or []).get("alma.join_id", b"").decode()
                    future = self._waiting.get(join_id)
                    if future is None or future.done():
                        continue  # someone else's reply, or one we already have
                    try:
                        future.set_result(MergeReply.model_validate(json.loads(record.value)))
                    except (ValueError, ValidationError) as exc:
                        future.set_exception(errors.MergeFailed(f"unreadable reply: {exc}"))

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
        ctx.validate(require_tenant=True)
        if not (ctx.tenant_id and ctx.workflow_id and ctx.run_id):
            raise errors.ContextError("merge needs tenant_id, workflow_id and run_id")
        join_id = join_id or uuid.uuid4().hex
        event = BranchJoin.model_validate({
            # A new event per attempt (the inbox would drop a repeated event_id); the
            # joiner recognises the join_id and answers a retry with the same reply.
            "event_id": uuid.uuid4().hex,
            "type": "branch.join",
            "emitted_at": datetime.now(UTC),
            "tenant_id": ctx.tenant_id, "workflow_id": ctx.workflow_id,
            "workflow_version": ctx.workflow_version, "run_id": ctx.run_id,
            "node_id": node_id or ctx.node_id,
            "payload": {"join_id": join_id, "branch_ids": branch_ids, "states": states,
                        "reducers": reducers, "default_reducer": default_reducer,
                        "strict": strict},
        }, strict=False)  # fmt: skip
        await self._ensure_listener()
        future: asyncio.Future[MergeReply] = asyncio.get_running_loop().create_future()
        self._waiting[join_id] = future
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
            self._waiting.pop(join_id, None)
        if reply.status == "error":
            raise errors.MergeFailed(f"join {join_id!r} of run {ctx.run_id!r}: {reply.error}")
        return reply
