"""The learner (group ``<prefix>-learner``): completions handed on by the
checkpointer in, outcomes and memories out (:mod:`alma_core.storage.memories`).

Per polled batch (gathered for up to ``ALMA_EMBED_MAX_WAIT_MS``): read the runs'
histories, draft what to learn (:mod:`alma_core.learning`), embed every text in
batches off the event loop, then apply one transaction. Join requests on the same
topic are the joiner's; the learner only moves its offsets past them. When idle,
it publishes leftover outbox rows and prunes what outlived its retention (the global
lifetimes, and a tenant's own checkpoint retention: :mod:`alma_core.storage.retention`).
A tenant whose learner is off (``alma tenants set T --learner off``, read every few
seconds: :mod:`alma_core.consumers.tenant_limits`) is passed by: nothing of its runs
drafted, embedded or stored.
"""

from __future__ import annotations

import logging
import time

from alma_core import learning
from alma_core.consumers.handler import StoreHandler, as_rejected, failure_text, reraise_retriable
from alma_core.consumers.metrics import Metrics
from alma_core.consumers.outbox import OutboxRelay
from alma_core.consumers.tenant_limits import LimitsReader
from alma_core.schemas.decoder import RejectReason
from alma_core.schemas.events import WorkflowCompleted
from alma_core.sequencing import Coordinates
from alma_core.settings import RetentionPolicy
from alma_core.storage import retention
from alma_core.storage.batches import Batch
from alma_core.storage.cache_writer import CacheWriter
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.storage.memories import LearnEffects, PostgresLearnStore, Prepared

log = logging.getLogger("alma.learner")

NAME = "learner"
GROUP = "learner"


class LearnHandler(StoreHandler[dict[Coordinates, Prepared], LearnEffects]):
    name = NAME
    store: PostgresLearnStore

    def __init__(
        self,
        store: PostgresLearnStore,
        cache: CacheWriter | None,
        relay: OutboxRelay,
        metrics: Metrics,
        embedder: AsyncEmbedder,
        *,
        max_state_bytes: int,
        max_record_bytes: int,
        retention: RetentionPolicy | None = None,
        prune_every_s: float = 300,
        limits: LimitsReader | None = None,
    ) -> None:
        super().__init__(
            store,
            cache,
            relay,
            metrics,
            max_state_bytes=max_state_bytes,
            max_record_bytes=max_record_bytes,
        )
        self.embedder = embedder
        self.retention = retention or RetentionPolicy()
        self.prune_every_s = prune_every_s
        self._last_prune = 0.0
        self._behind = False  # the last round stopped at its limit: prune again next round
        # the tenants whose learner is off, among the tenants' settings read every few s
        self.limits = limits or LimitsReader(store.pool, metrics, max_state_bytes=max_state_bytes)

    async def prepare(self, incoming: Batch) -> tuple[Batch, dict[Coordinates, Prepared]]:
        """Draft and embed the completions first (no transaction open meanwhile). If
        that fails for a reason other than the server's, prepare record by record, and a
        record that fails alone becomes an ``internal_error`` rejection (dead-lettered,
        replayable) instead of stopping the partition."""
        try:
            with self.step("embed"):
                return incoming, await self._draft_and_embed(incoming)
        except Exception as exc:  # noqa: BLE001 - isolated below, retriable ones re-raised
            reraise_retriable(exc)
        prepared: dict[Coordinates, Prepared] = {}
        batch: Batch = {}
        for tp, records in incoming.items():
            for record in records:
                try:
                    prepared.update(await self._draft_and_embed({tp: [record]}))
                except Exception as exc:  # noqa: BLE001 - dead-lettered as internal_error
                    reraise_retriable(exc)
                    failure = f"preparing: {failure_text(exc)}"
                    record = as_rejected(record, RejectReason.INTERNAL_ERROR, failure)
                batch.setdefault(tp, []).append(record)
        return batch, prepared

    async def _draft_and_embed(self, incoming: Batch) -> dict[Coordinates, Prepared]:
        """Draft and embed every completion not learned yet (reads only, no transaction);
        those of a tenant whose learner is off are marked so, unread and unembedded."""
        completions = [
            (r, r.decoded)
            for rs in incoming.values()
            for r in rs
            if isinstance(r.decoded, WorkflowCompleted)
        ]
        off = (await self.limits.current()).not_learning if completions else frozenset()
        passed_by = {
            r.coords: Prepared(
                draft=learning.draft(_finished(e), []),
                vectors={},
                artifacts=[],
                cleanup=self._cleanup(e),
                learn=False,
            )
            for r, e in completions
            if e.tenant_id in off
        }
        completions = [(r, e) for r, e in completions if e.tenant_id not in off]
        known = await self.store.learned([e for _, e in completions])
        fresh = [(r, e) for r, e in completions if (e.tenant_id, e.event_id) not in known]
        if not fresh:
            return passed_by
        histories = await self.store.histories(sorted({(e.tenant_id, e.run_id) for _, e in fresh}))
        drafts = [
            (r, e, learning.draft(_finished(e), histories.get((e.tenant_id, e.run_id), [])))
            for r, e in fresh
        ]
        texts = [t for _, _, d in drafts for t in d.texts()]

        def observe(size: int, seconds: float) -> None:
            self.metrics.embed_batch.observe(size)
            self.metrics.embed_seconds.observe(seconds)

        encoded_before = self.embedder.encoded
        vectors = await self.embedder.embed(texts, observe)
        encoded = self.embedder.encoded - encoded_before
        self.metrics.embeddings.labels("encoded").inc(encoded)
        self.metrics.embeddings.labels("cached").inc(len(texts) - encoded)
        by_text = dict(zip(texts, vectors, strict=True))
        return passed_by | {
            r.coords: Prepared(
                draft=d,
                vectors={t: by_text[t] for t in d.texts()},
                artifacts=list(e.payload.artifacts),
                cleanup=self._cleanup(e),
            )
            for r, e, d in drafts
        }

    def _cleanup(self, e: WorkflowCompleted) -> bool:
        """Whether the run's checkpoints go once it completed (the event, else the default)."""
        if e.payload.cleanup_checkpoints is None:
            return self.store.config.cleanup_checkpoints
        return e.payload.cleanup_checkpoints

    async def idle(self) -> None:
        await super().idle()
        if self.prune_every_s <= 0:  # a tenant's own retention may hold with no global one
            return
        if not self._behind and time.monotonic() - self._last_prune < self.prune_every_s:
            return
        self._last_prune = time.monotonic()
        pruned = await retention.prune(self.store.pool, self.retention, max_batches=5)
        self._behind = pruned.more
        if pruned.pruned and self.cache is not None:
            await self.cache.forget(pruned.pruned)
        if pruned.checkpoints:
            self.metrics.checkpoints_pruned.labels("retention").inc(pruned.checkpoints)
        rows = {table: n for table, n in pruned.rows().items() if n}
        for table, n in rows.items():
            self.metrics.rows_pruned.labels(table).inc(n)
        if rows:
            log.info(
                "pruned old rows",
                extra={"action": "prune", "rows": rows, "runs": pruned.runs, "more": pruned.more},
            )

    def observe(self, effects: LearnEffects) -> None:
        m = self.metrics
        if effects.outcomes:
            m.outcomes.labels("stored").inc(effects.outcomes)
            m.events.labels(NAME, "workflow.completed", "stored").inc(effects.outcomes)
        if effects.not_learned:
            m.outcomes.labels("not_learned").inc(effects.not_learned)
        if effects.duplicates:
            m.outcomes.labels("duplicate").inc(effects.duplicates)
            m.duplicates.labels(NAME).inc(effects.duplicates)
        for kind, n in effects.memories.items():
            m.memories.labels(kind).inc(n)
        if effects.checkpoints_removed:
            m.checkpoints_pruned.labels("cleanup").inc(effects.checkpoints_removed)


def _finished(e: WorkflowCompleted) -> learning.FinishedRun:
    p = e.payload
    return learning.FinishedRun(
        tenant_id=e.tenant_id,
        workflow_id=e.workflow_id,
        run_id=e.run_id,
        event_id=e.event_id,
        success=p.outcome == "success",
        duration_ms=p.duration_ms,
        node_count=p.node_count,
        nodes_succeeded=p.nodes_succeeded,
        nodes_failed=p.nodes_failed,
        workflow_version=e.workflow_version,
        error_message=p.error_message,
        task=p.task,
    )
