"""The joiner (group ``<prefix>-joiner``): merge requests handed on by the
checkpointer in, merged checkpoints and replies out (:mod:`alma_core.join_store`).
Completion events on the same topic are the learner's; the joiner only moves
its offsets past them."""

from __future__ import annotations

import time
from typing import Any

from alma_core.batch_store import Incoming
from alma_core.cache import CacheWriter
from alma_core.join_store import JoinBatchResult, PostgresJoinStore
from alma_core.offsets import TopicPartition
from alma_core.resume import cache_entries
from consumers.metrics import Metrics
from consumers.outbox import OutboxRelay
from consumers.runtime import HandleResult
from schemas.decoder import decode

NAME = "joiner"
GROUP = "joiner"


class JoinHandler:
    name = NAME

    def __init__(
        self,
        store: PostgresJoinStore,
        cache: CacheWriter | None,
        relay: OutboxRelay,
        metrics: Metrics,
        *,
        max_record_bytes: int,
    ) -> None:
        self.store = store
        self.cache = cache
        self.relay = relay
        self.metrics = metrics
        self.max_record_bytes = max_record_bytes

    async def positions(
        self, cluster_id: str, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        return await self.store.stored_offsets(cluster_id, partitions)

    async def idle(self) -> None:
        await self.relay.sweep()

    async def handle(self, cluster_id: str, batch: dict[TopicPartition, list[Any]]) -> HandleResult:
        started = time.perf_counter()
        incoming = {
            tp: [
                Incoming(r.topic, r.partition, r.offset, r.key, r.value,
                         decode(r.value, key=r.key, max_state_bytes=self.max_record_bytes,
                                max_record_bytes=self.max_record_bytes))
                for r in records
            ]
            for tp, records in batch.items()
        }  # fmt: skip
        result = await self.store.apply(cluster_id, incoming)
        self._observe(result)
        if self.cache is not None and result.checkpoints:
            entries = [e for cp in result.checkpoints for e in cache_entries({None: cp})]
            ok = await self.cache.write(entries)
            self.metrics.cache.labels("write" if ok else "write_error").inc()
        await self.relay.publish(result.outbox_ids)
        self.metrics.batch_seconds.labels(NAME).observe(time.perf_counter() - started)
        return HandleResult(result.next_offsets, result.seeks)

    def _observe(self, result: JoinBatchResult) -> None:
        m = self.metrics
        for outcome, n in result.outcomes.items():
            m.merges.labels(outcome).inc(n)
            m.events.labels(NAME, "branch.join", outcome).inc(n)
        for seconds in result.merge_seconds:
            m.merge_seconds.observe(seconds)
        for cp in result.checkpoints:
            m.checkpoints.labels(NAME, cp.kind).inc()
        for dl in result.dead_letters:
            m.dead_letters.labels(NAME, dl.reason).inc()
        if result.already_applied:
            m.duplicates.labels(NAME).inc(result.already_applied)
