"""What the checkpointer's and the joiner's batch handlers share: a store that keeps
its offsets in PostgreSQL, the cache writer, the outbox relay, the metrics, and
decoding a polled batch."""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, ClassVar, TypeVar, cast

from alma_core import errors
from alma_core.storage.batches import (
    BatchStore,
    Incoming,
    dead_letter_for,
    dead_letter_headers,
)
from alma_core.storage.cache import CacheWriter
from alma_core.storage.offsets import TopicPartition
from consumers.metrics import Metrics
from consumers.outbox import OutboxRelay
from schemas.decoder import Rejection, RejectReason, decode

log = logging.getLogger("alma.consumers")

R = TypeVar("R")
Batch = dict[TopicPartition, list[Incoming]]


class StoreHandler:
    name = "handler"
    # The store's result type: built empty (offsets only) when a record is skipped.
    result_type: ClassVar[Callable[..., Any]]

    def __init__(
        self,
        store: BatchStore,
        cache: CacheWriter | None,
        relay: OutboxRelay,
        metrics: Metrics,
        *,
        max_state_bytes: int,
        max_record_bytes: int,
    ) -> None:
        self.store = store
        self.cache = cache
        self.relay = relay
        self.metrics = metrics
        self.max_state_bytes = max_state_bytes
        self.max_record_bytes = max_record_bytes

    async def positions(
        self, cluster_id: str, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        return await self.store.stored_offsets(cluster_id, partitions)

    async def idle(self) -> None:
        await self.relay.sweep()

    def decode_batch(
        self, batch: dict[TopicPartition, list[Any]]
    ) -> dict[TopicPartition, list[Incoming]]:
        return {
            tp: [
                Incoming(r.topic, r.partition, r.offset, r.key, r.value,
                         decode(r.value, key=r.key, max_state_bytes=self.max_state_bytes,
                                max_record_bytes=self.max_record_bytes),
                         tuple(r.headers or ()))
                for r in records
            ]
            for tp, records in batch.items()
        }  # fmt: skip

    async def apply_all(
        self, cluster_id: str, batch: Batch, apply: Callable[[str, Batch], Awaitable[R]]
    ) -> list[R]:
        """Apply a batch. Unless the failure is the server's (a retriable StorageError:
        the runtime pauses and retries), apply its records one by one and dead-letter
        the one that fails alone — refused by PostgreSQL (``storage_rejected``) or any
        other error (``internal_error``) — so no record can stop a partition."""
        try:
            return [await apply(cluster_id, batch)]
        except Exception as exc:  # noqa: BLE001 - isolated below, retriable ones re-raised
            reraise_retriable(exc)
            log.warning(
                "a batch failed; applying its records one by one",
                extra={
                    "action": "isolate_batch",
                    "consumer": self.name,
                    "error": failure_text(exc),
                },
            )
        return [
            await self._apply_alone(cluster_id, tp, record, apply)
            for tp, records in batch.items()
            for record in records
        ]

    async def _apply_alone(
        self,
        cluster_id: str,
        tp: TopicPartition,
        record: Incoming,
        apply: Callable[[str, Batch], Awaitable[R]],
    ) -> R:
        try:
            return await apply(cluster_id, {tp: [record]})
        except Exception as exc:  # noqa: BLE001 - dead-lettered below
            reraise_retriable(exc)
            if isinstance(record.decoded, Rejection):  # its dead letter is what failed
                return cast(R, await self._last_resort(cluster_id, tp, record, failure_text(exc)))
            reason = (
                RejectReason.STORAGE_REJECTED
                if isinstance(exc, errors.StorageError)
                else RejectReason.INTERNAL_ERROR
            )
            failure = failure_text(exc)
        rejected = as_rejected(record, reason, failure)
        try:
            return await apply(cluster_id, {tp: [rejected]})
        except Exception as exc:  # noqa: BLE001 - the last resort below
            reraise_retriable(exc)
            return cast(R, await self._last_resort(cluster_id, tp, rejected, failure_text(exc)))

    async def _last_resort(
        self, cluster_id: str, tp: TopicPartition, record: Incoming, failure: str
    ) -> Any:
        """Even the dead-letter row was refused: move the partition past the record, send
        the record to the dead-letter topic directly, log it whole and count it
        (``alma_dead_letter_failures_total`` raises an alert). Nothing is lost: the
        bytes are in the dead-letter topic (or, if that fails too, in the log), and the
        record stays at its offset in the source topic."""
        fenced = await self.store.skip(cluster_id, {tp: [record]})
        result = self.result_type(next_offsets=fenced.next_offsets, seeks=fenced.seeks)
        if not fenced.todo:
            return result  # already past it (a redelivery): nothing to do
        assert isinstance(record.decoded, Rejection)
        letter = dead_letter_for(record, record.decoded)
        headers = {**dead_letter_headers(self.name, letter), "alma.dead_letter_stored": "false"}
        sent = await self.relay.send_now(
            self.store.dlq_topic, record.key, record.value or b"",
            [(k, str(v)) for k, v in headers.items() if v is not None],
        )  # fmt: skip
        self.metrics.dead_letter_failures.labels(self.name).inc()
        self.metrics.dead_letters.labels(self.name, letter.reason).inc()
        log.error(
            "a dead letter could not be stored; the partition moves past it",
            extra={"action": "dead_letter_unstorable", "consumer": self.name,
                   "reason": letter.reason, "error": failure[:500], "topic": record.topic,
                   "partition": record.partition, "offset": record.offset,
                   "sent_to_dead_letter_topic": sent,
                   "key_base64": base64.b64encode(record.key or b"").decode(),
                   "value_base64": base64.b64encode(record.value or b"").decode()},
        )  # fmt: skip
        return result


def as_rejected(record: Incoming, reason: RejectReason, failure: str) -> Incoming:
    """``record`` as a rejection to dead-letter, with the ids its decoding found."""
    decoded = record.decoded
    return replace(
        record,
        decoded=Rejection(reason, failure[:500], event_id=getattr(decoded, "event_id", None),
                          run_id=getattr(decoded, "run_id", None),
                          tenant_id=getattr(decoded, "tenant_id", None)),
    )  # fmt: skip


def reraise_retriable(exc: Exception) -> None:
    """The server's failures are retried by the runtime, never dead-lettered."""
    if isinstance(exc, errors.AlmaError) and exc.retriable:
        raise exc


def failure_text(exc: BaseException) -> str:
    return exc.message if isinstance(exc, errors.AlmaError) else repr(exc)
