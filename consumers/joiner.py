"""The joiner (group ``<prefix>-joiner``): merge requests handed on by the
checkpointer in, merged checkpoints and replies out (:mod:`alma_core.storage.joins`).
Completion events on the same topic are the learner's; the joiner only moves
its offsets past them."""

from __future__ import annotations

from alma_core.consumers.handler import StoreHandler
from alma_core.storage.batches import Batch
from alma_core.storage.joins import JoinEffects

NAME = "joiner"
GROUP = "joiner"


class JoinHandler(StoreHandler[None, JoinEffects]):
    name = NAME

    async def prepare(self, incoming: Batch) -> tuple[Batch, None]:
        return incoming, None  # everything a merge needs is read in its transaction

    def observe(self, effects: JoinEffects) -> None:
        m = self.metrics
        for result, n in effects.outcomes.items():
            m.merges.labels(result).inc(n)
            m.events.labels(NAME, "branch.join", result).inc(n)
        for seconds in effects.merge_seconds:
            m.merge_seconds.observe(seconds)
        for cp in effects.checkpoints:
            m.checkpoints.labels(NAME, cp.kind).inc()
