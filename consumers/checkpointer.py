"""The checkpointer (group ``<prefix>-checkpointer``): lifecycle events in, ordered
exactly-once checkpoints out. Decode, apply in one transaction
(:mod:`alma_core.storage.checkpoints`; a new run of a tenant at its storage quota is
refused there, a state over its tenant's limit too), then the shared post-commit step
(cache, outbox, offsets) of :class:`~alma_core.consumers.handler.StoreHandler`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from alma_core import tracing
from alma_core.consumers.handler import StoreHandler
from alma_core.consumers.tenant_limits import LimitsReader
from alma_core.quotas import TenantLimits
from alma_core.storage.batches import Batch
from alma_core.storage.checkpoints import CheckpointEffects, PostgresCheckpointStore

NAME = "checkpointer"
GROUP = "checkpointer"  # the group id is f"{ALMA_GROUP_PREFIX}-checkpointer"


class CheckpointHandler(StoreHandler[TenantLimits, CheckpointEffects]):
    name = NAME
    store: PostgresCheckpointStore

    def __init__(self, *args: Any, limits: LimitsReader | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.store.config  # the tenants' limits below its global ones
        self.limits = limits or LimitsReader(
            self.store.pool,
            self.metrics,
            max_state_bytes=config.max_state_bytes,
            storage_quota=config.storage_quota,
            storage=True,
        )

    async def prepare(self, incoming: Batch) -> tuple[Batch, TenantLimits]:
        """The tenants' own limits (:mod:`alma_core.consumers.tenant_limits`);
        everything else the fold needs is read in its transaction."""
        return incoming, await self.limits.current()

    async def idle(self) -> None:
        """The outbox's sweep, and the tenants' limits and their gauges (storage, blocked
        runs) read again on time when no batch comes: an alert on a gauge stays true to
        what PostgreSQL holds while the topics are quiet."""
        await super().idle()
        await self.limits.current()

    def observe(self, effects: CheckpointEffects) -> None:
        m = self.metrics
        # Counted per kind, type and effect, not per event: a series' lookup costs more
        # than the increment (~0.3 s of every 20,000 events when done per event).
        for kind, n in Counter(row.kind for row in effects.checkpoints).items():
            m.checkpoints.labels(NAME, kind).inc(n)
        now = effects.created_at
        for (type_, effect), n in Counter((t, e) for t, e, _ in effects.applied).items():
            m.events.labels(NAME, type_, effect).inc(n)
        latency: dict[str, Any] = {}
        exemplar = tracing.exemplar() if self.tracer is not None else None  # the batch's
        for type_, _, emitted_at in effects.applied:
            series = latency.get(type_)
            if series is None:
                series = latency[type_] = m.e2e_seconds.labels(NAME, type_)
            series.observe(max(0.0, (now - emitted_at).total_seconds()), exemplar)
        if effects.duplicates:
            m.duplicates.labels(NAME).inc(effects.duplicates)
        if effects.read_again:
            m.read_again.labels(NAME).inc()
        path = "remembered" if effects.recalled else "unlocked" if effects.unlocked else "locked"
        m.batch_writes.labels(NAME, path).inc()
        if effects.dead_letters:
            m.events.labels(NAME, "unknown", "dead_letter").inc(len(effects.dead_letters))
