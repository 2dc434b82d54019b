"""What the checkpointer's and the joiner's batch handlers share: a store that keeps
its offsets in PostgreSQL, the cache writer, the outbox relay, the metrics, and
decoding a polled batch."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from alma_core import errors
from alma_core.storage.batches import BatchStore, Incoming
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
                                max_record_bytes=self.max_record_bytes))
                for r in records
            ]
            for tp, records in batch.items()
        }  # fmt: skip

    async def apply_all(
        self, cluster_id: str, batch: Batch, apply: Callable[[str, Batch], Awaitable[R]]
    ) -> list[R]:
        """Apply a batch; if PostgreSQL refuses it for its data (not an outage), apply its
        records one by one and dead-letter the one refused alone (`storage_rejected`), so
        no record can stop a partition."""
        try:
            return [await apply(cluster_id, batch)]
        except errors.StorageRejected as exc:
            log.warning(
                "PostgreSQL refused a batch; applying its records one by one",
                extra={"action": "isolate_batch", "consumer": self.name, "error": exc.message},
            )
        results = []
        for tp, records in batch.items():
            for record in records:
                try:
                    results.append(await apply(cluster_id, {tp: [record]}))
                except errors.StorageRejected as exc:
                    rejected = Incoming(
                        record.topic, record.partition, record.offset, record.key, record.value,
                        Rejection(RejectReason.STORAGE_REJECTED, exc.message[:500],
                                  event_id=getattr(record.decoded, "event_id", None),
                                  run_id=getattr(record.decoded, "run_id", None),
                                  tenant_id=getattr(record.decoded, "tenant_id", None)),
                    )  # fmt: skip
                    results.append(await apply(cluster_id, {tp: [rejected]}))
        return results
