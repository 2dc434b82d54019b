"""The joiner (group ``<prefix>-joiner``): merge requests handed on by the
checkpointer in, merged checkpoints and replies out (:mod:`alma_core.storage.joins`).
Completion events on the same topic are the learner's; the joiner only moves
its offsets past them."""

from __future__ import annotations

import time
from typing import Any

from alma_core.storage.cache import cache_entries
from alma_core.storage.joins import JoinBatchResult, PostgresJoinStore
from alma_core.storage.offsets import TopicPartition
from consumers.handler import StoreHandler
from consumers.runtime import HandleResult

NAME = "joiner"
GROUP = "joiner"


class JoinHandler(StoreHandler):
    name = NAME
    result_type = JoinBatchResult
    store: PostgresJoinStore

    async def handle(self, cluster_id: str, batch: dict[TopicPartition, list[Any]]) -> HandleResult:
        started = time.perf_counter()
        results = await self.apply_all(cluster_id, self.decode_batch(batch), self.store.apply)
        out = HandleResult()
        for result in results:
            self._observe(result)
            if self.cache is not None and result.checkpoints:
                entries = [e for cp in result.checkpoints for e in cache_entries({None: cp})]
                ok = await self.cache.write(entries)
                self.metrics.cache.labels("write" if ok else "write_error").inc()
            await self.relay.publish(result.outbox_ids)
            out.next_offsets.update(result.next_offsets)
            out.seeks.update(result.seeks)
        self.metrics.batch_seconds.labels(NAME).observe(time.perf_counter() - started)
        return out

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
