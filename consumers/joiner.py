"""The joiner (group ``<prefix>-joiner``): merge requests handed on by the
checkpointer in, merged checkpoints and replies out (:mod:`alma_core.storage.joins`).
Completion events on the same topic are the learner's; the joiner only moves
its offsets past them."""

from __future__ import annotations

import logging
from typing import Any

from alma_core.consumers.handler import StoreHandler
from alma_core.consumers.tenant_limits import LimitsReader
from alma_core.quotas import TenantLimits
from alma_core.storage.batches import Batch
from alma_core.storage.joins import JoinEffects, PostgresJoinStore

NAME = "joiner"
GROUP = "joiner"
log = logging.getLogger("alma.consumers")


class JoinHandler(StoreHandler[TenantLimits, JoinEffects]):
    name = NAME
    store: PostgresJoinStore

    def __init__(self, *args: Any, limits: LimitsReader | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the tenants' own state size limits, below the store's (its records' is larger)
        self.limits = limits or LimitsReader(
            self.store.pool, self.metrics, max_state_bytes=self.store.config.max_state_bytes
        )

    async def prepare(self, incoming: Batch) -> tuple[Batch, TenantLimits]:
        """The tenants' own state size limits (:mod:`alma_core.consumers.tenant_limits`);
        everything else a merge needs is read in its transaction."""
        return incoming, await self.limits.current()

    def observe(self, effects: JoinEffects) -> None:
        m = self.metrics
        for result, n in effects.outcomes.items():
            m.merges.labels(result).inc(n)
            m.events.labels(NAME, "branch.join", result).inc(n)
        for d in effects.decisions:
            if d.lost:
                log.warning(
                    "join handed off from a commit PostgreSQL no longer has (a failover "
                    "lost it): not merged; the checkpointer hands it off again",
                    extra={
                        "action": "join_handoff_lost",
                        "run_id": d.event.run_id,
                        "tenant_id": d.event.tenant_id,
                        "join_id": d.event.payload.join_id,
                    },
                )
        for seconds in effects.merge_seconds:
            m.merge_seconds.observe(seconds)
        for cp in effects.checkpoints:
            m.checkpoints.labels(NAME, cp.kind).inc()
