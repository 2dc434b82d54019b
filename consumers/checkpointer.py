"""The checkpointer (group ``alma-checkpointer``): lifecycle events in, ordered
exactly-once checkpoints out. Decode, apply in one transaction
(:mod:`alma_core.storage.checkpoints`), then cache, publish the outbox, and let
the runtime commit to Kafka.

A batch that PostgreSQL refuses for its data (not for an outage) is split:
each record is applied alone, and the one refused alone is dead-lettered
with reason ``storage_rejected``, so no record can stop a partition.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from alma_core.sequencing import CheckpointRow
from alma_core.storage.batches import Incoming
from alma_core.storage.cache import cache_entries
from alma_core.storage.checkpoints import BatchResult, PostgresCheckpointStore
from alma_core.storage.offsets import TopicPartition
from alma_core.types import Checkpoint
from consumers.handler import StoreHandler
from consumers.runtime import HandleResult

log = logging.getLogger("alma.checkpointer")

NAME = "checkpointer"
GROUP = "checkpointer"  # the group id is f"{ALMA_GROUP_PREFIX}-checkpointer"


def _checkpoint(row: CheckpointRow, created_at: datetime) -> Checkpoint:
    return Checkpoint(
        run_id=row.run_id,
        tenant_id=row.tenant_id,
        seq=row.seq,
        state=row.state,
        state_hash=row.state_hash,
        size_bytes=row.size_bytes,
        kind=row.kind,
        node_id=row.node_id,
        branch_id=row.branch_id,
        parent_seq=row.parent_seq,
        event_id=row.event_id,
        metadata=row.metadata,
        created_at=created_at,
    )


class CheckpointHandler(StoreHandler):
    name = NAME
    result_type = BatchResult
    store: PostgresCheckpointStore

    async def handle(self, cluster_id: str, batch: dict[TopicPartition, list[Any]]) -> HandleResult:
        started = time.perf_counter()
        incoming = self.decode_batch(batch)
        count = sum(len(rs) for rs in incoming.values())
        results = await self.apply_all(cluster_id, incoming, self._apply)
        out = HandleResult()
        for result in results:
            self._observe(result)
            await self._write_cache(result)
            await self.relay.publish(result.outbox_ids)
            out.next_offsets.update(result.next_offsets)
            out.seeks.update(result.seeks)
        self.metrics.batch_seconds.labels(NAME).observe(time.perf_counter() - started)
        self.metrics.batch_size.labels(NAME).observe(count)
        return out

    async def _apply(
        self, cluster_id: str, batch: dict[TopicPartition, list[Incoming]]
    ) -> BatchResult:
        started = time.perf_counter()
        result = await self.store.apply(cluster_id, batch)
        self.metrics.transaction_seconds.labels(NAME).observe(time.perf_counter() - started)
        return result

    def _observe(self, result: BatchResult) -> None:
        m = self.metrics
        for row in result.checkpoints:
            m.checkpoints.labels(NAME, row.kind).inc()
        now = result.created_at
        for type_, effect, emitted_at in result.applied:
            m.events.labels(NAME, type_, effect).inc()
            m.e2e_seconds.labels(NAME, type_).observe(max(0.0, (now - emitted_at).total_seconds()))
        if result.duplicates or result.already_applied:
            m.duplicates.labels(NAME).inc(result.duplicates + result.already_applied)
        for dl in result.dead_letters:
            m.dead_letters.labels(NAME, dl.reason).inc()
            m.events.labels(NAME, "unknown", "dead_letter").inc()
            log.warning(
                "dead letter",
                extra={"action": "dead_letter", "consumer": NAME, "reason": dl.reason,
                       "detail": dl.detail[:300], "event_id": dl.event_id, "run_id": dl.run_id,
                       "partition": dl.record.partition, "offset": dl.record.offset},
            )  # fmt: skip

    async def _write_cache(self, result: BatchResult) -> None:
        if self.cache is None or not result.heads:
            return
        by_run: dict[str, dict[str | None, Checkpoint]] = {}
        for row in result.heads.values():
            by_run.setdefault(row.run_id, {})[row.branch_id] = _checkpoint(row, result.created_at)
        entries = [e for heads in by_run.values() for e in cache_entries(heads)]
        if await self.cache.write(entries):
            self.metrics.cache.labels("write").inc(len(entries))
        else:
            self.metrics.cache.labels("write_error").inc()
