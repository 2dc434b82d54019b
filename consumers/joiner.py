"""The joiner (group ``<prefix>-joiner``): merge requests handed on by the
checkpointer in, merged checkpoints and replies out (:mod:`alma_core.storage.joins`).
Completion events on the same topic are the learner's; the joiner only moves
its offsets past them."""

from __future__ import annotations

from alma_core.storage.batches import Batch
from alma_core.storage.joins import JoinOutcome, PostgresJoinStore
from consumers.handler import Apply, StoreHandler

NAME = "joiner"
GROUP = "joiner"


class JoinHandler(StoreHandler[JoinOutcome]):
    name = NAME
    result_type = JoinOutcome
    store: PostgresJoinStore

    async def prepare(self, incoming: Batch) -> Apply[JoinOutcome]:
        return self.store.apply

    def observe(self, outcome: JoinOutcome) -> None:
        m = self.metrics
        for result, n in outcome.outcomes.items():
            m.merges.labels(result).inc(n)
            m.events.labels(NAME, "branch.join", result).inc(n)
        for seconds in outcome.merge_seconds:
            m.merge_seconds.observe(seconds)
        for cp in outcome.checkpoints:
            m.checkpoints.labels(NAME, cp.kind).inc()
