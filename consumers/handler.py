"""What the checkpointer's and the joiner's batch handlers share: a store that keeps
its offsets in PostgreSQL, the cache writer, the outbox relay, the metrics, and
decoding a polled batch."""

from __future__ import annotations

from typing import Any

from alma_core.batch_store import BatchStore, Incoming
from alma_core.cache import CacheWriter
from alma_core.offsets import TopicPartition
from consumers.metrics import Metrics
from consumers.outbox import OutboxRelay
from schemas.decoder import decode


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
