"""What every consumer group's batch handler shares, top to bottom:

1. decode the polled batch (:meth:`StoreHandler.decode_batch`);
2. prepare what the store needs before its transaction (:meth:`StoreHandler.prepare`:
   the learner's drafts and embeddings; nothing for the others);
3. commit it through the store, one transaction per group of partitions
   (:meth:`~alma_core.storage.batches.BatchStore.transact`), record by record if the
   batch fails, so one record never stops a partition
   (:meth:`StoreHandler.commit_or_isolate`);
4. the one post-commit step: metrics and logs, the cache, the outbox
   (:meth:`StoreHandler.after_commit`);
5. hand the runtime the batch's :class:`~alma_core.storage.offsets.Progress`.

A handler adds its own metrics (``observe``) and, for the learner, ``prepare``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any, Generic, Protocol

from alma_core import errors, tracing
from alma_core.consumers.metrics import Metrics
from alma_core.consumers.spans import BatchSpans, BatchTracer
from alma_core.schemas.decoder import Rejection, RejectReason, decode
from alma_core.storage.batches import Batch, BatchStore, Committed, EffectsT, Incoming, PreparedT
from alma_core.storage.cache_writer import CacheWriter
from alma_core.storage.dead_letters import dead_letter_for, dead_letter_headers
from alma_core.storage.offsets import PartitionKey, Progress
from alma_core.tenancy import TENANT_REFUSALS, TenantTopics

log = logging.getLogger("alma.consumers")

# A batch is split into concurrent transactions only where each carries this much
# record data: below it a second transaction's fixed cost (its round trips and their
# Python) outweighs the PostgreSQL work it takes off the first (docs/checkpointer.md).
SPLIT_BYTES = 256 * 1024


class Relay(Protocol):
    """What the handler asks of the outbox relay
    (:class:`~alma_core.consumers.outbox.OutboxRelay`)."""

    async def publish(self, ids: list[int]) -> int: ...

    async def send_now(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, str]]
    ) -> bool: ...

    async def sweep(self, *, force: bool = False) -> int: ...


class StoreHandler(Generic[PreparedT, EffectsT]):
    name = "handler"

    def __init__(
        self,
        store: BatchStore[PreparedT, EffectsT, Any],
        cache: CacheWriter | None,
        relay: Relay,
        metrics: Metrics,
        *,
        max_state_bytes: int,
        max_record_bytes: int,
        concurrency: int = 1,
        topics: TenantTopics | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.relay = relay
        self.metrics = metrics
        self.max_state_bytes = max_state_bytes
        self.max_record_bytes = max_record_bytes
        # Transactions one batch may run at once, each on its own partitions: only for a
        # store whose transactions touch nothing but their partitions' runs (the
        # checkpointer's); see partition_groups.
        self.concurrency = concurrency
        self.tracer: BatchTracer | None = None  # set by the worker when traces are on
        # With ALMA_TENANT_TOPICS, the lifecycle topics' names: each record is bound to
        # the tenant of the topic it was read from (alma_core.tenancy), the checkpointer's
        self.bind = topics.bind if topics is not None and topics.per_tenant else None

    async def positions(
        self, cluster_id: str, partitions: list[PartitionKey]
    ) -> dict[PartitionKey, int]:
        return await self.store.stored_offsets(cluster_id, partitions)

    async def idle(self) -> None:
        await self.relay.sweep()

    async def assigned(self, partitions: list[PartitionKey]) -> None:
        """The cache entries of partitions newly assigned here become unreachable: a
        member that died may have left some its successor's writes would not replace.
        The cache is partitioned as the topics are (``ALMA_PARTITIONS``)."""
        await self.store.assigned(partitions)
        if self.cache is not None:
            await self.cache.invalidate(p for _, p in partitions)
        if self.tracer is not None:
            await self.tracer.assigned(partitions)

    def step(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A span of one step of the current batch (a child of its span), when traced."""
        if self.tracer is None:
            return contextlib.nullcontext()
        return tracing.tracer().start_as_current_span(f"{self.name} {name}")

    async def handle(
        self,
        cluster_id: str,
        batch: dict[PartitionKey, list[Any]],
        read_from: dict[PartitionKey, int] | None = None,
    ) -> Progress:
        """Decode, prepare, commit (or isolate), post-commit; the batch's progress.
        ``read_from``: where the consumer read each partition's records from, when it
        knows. A retriable :class:`errors.StorageError` goes up (the runtime retries)."""
        started = time.perf_counter()
        decoded = self.decode_batch(batch, read_from or {})
        if self.tracer is None:
            return await self._handle(cluster_id, decoded, started, None)
        async with self.tracer.open(decoded) as spans:
            return await self._handle(cluster_id, spans.incoming, started, spans)

    async def _handle(
        self, cluster_id: str, decoded: Batch, started: float, spans: BatchSpans | None
    ) -> Progress:
        incoming, prepared = await self.prepare(decoded)
        groups = partition_groups(incoming, self._transactions(incoming))
        if len(groups) == 1:
            done: list[list[Committed[EffectsT]] | BaseException] = [
                await self.commit_or_isolate(cluster_id, incoming, prepared)
            ]
        else:
            # every group to its end, then the post-commit step of those that committed;
            # a failure is raised after it (the retry finds their records applied)
            done = await asyncio.gather(
                *(self.commit_or_isolate(cluster_id, g, prepared) for g in groups),
                return_exceptions=True,
            )
        parts: list[Progress] = []
        for applied in done:
            if isinstance(applied, BaseException):
                continue
            for part in applied:
                await self.after_commit(part)
                parts.append(part.progress)
                if spans is not None:
                    spans.committed(part)
        for applied in done:
            if isinstance(applied, BaseException):
                raise applied
        exemplar = tracing.exemplar() if spans is not None else None
        self.metrics.batch_seconds.labels(self.name).observe(
            time.perf_counter() - started, exemplar
        )
        self.metrics.batch_size.labels(self.name).observe(sum(len(rs) for rs in incoming.values()))
        return Progress.of(parts)

    def _transactions(self, incoming: Batch) -> int:
        """How many transactions this batch is worth (see SPLIT_BYTES)."""
        if self.concurrency <= 1:
            return 1
        size = sum(len(r.value or b"") for records in incoming.values() for r in records)
        return max(1, min(self.concurrency, size // SPLIT_BYTES))

    async def prepare(self, incoming: Batch) -> tuple[Batch, PreparedT]:
        """Work before the transaction (reads, embeddings): the batch to apply (a record
        that cannot be prepared becomes a rejection) and what the store needs of it."""
        raise NotImplementedError

    def observe(self, effects: EffectsT) -> None:
        """The handler's own metrics of a committed batch's effects."""

    async def after_commit(self, applied: Committed[EffectsT]) -> None:
        """The same for every group, once the batch is durable: count and log its dead
        letters and redeliveries, write the cache (never back: docs/guarantees.md §4), publish
        the outbox."""
        m = self.metrics
        progress, effects = applied.progress, applied.effects
        if progress.already_applied:
            m.duplicates.labels(self.name).inc(progress.already_applied)
        for (topic, partition), (start, end) in progress.holes.items():
            m.offsets_skipped.labels(self.name).inc(end - start)
            log.log(
                logging.INFO if end - start == 1 else logging.WARNING,
                "the log holds no record at these offsets (a transaction marker, or records "
                "removed by retention or compaction); the partition moves past them",
                extra={
                    "action": "log_hole",
                    "consumer": self.name,
                    "topic": topic,
                    "partition": partition,
                    "from_offset": start,
                    "to_offset": end,
                },
            )
        if effects is None:
            return
        self.observe(effects)
        for dl in effects.dead_letters:
            m.dead_letters.labels(self.name, dl.reason).inc()
            if dl.reason in TENANT_REFUSALS:  # labelled by the topic's tenant, not the claim
                m.tenant_refusals.labels(dl.tenant_id or "", dl.reason).inc()
            elif dl.reason == errors.StorageQuotaExceeded.reason:
                m.tenant_storage_refused.labels(dl.tenant_id or "").inc()
            # the event's own trace (its span's context, which the record carries here),
            # not the batch's: a search of the logs for the event's trace finds it
            event = tracing.extract(getattr(dl.record, "headers", ())) if self.tracer else None
            log.warning(
                "dead letter",
                extra={
                    **(tracing.current_ids(event) if event is not None else {}),
                    "action": "dead_letter",
                    "consumer": self.name,
                    "reason": dl.reason,
                    "detail": dl.detail[:300],
                    "event_id": dl.event_id,
                    "run_id": dl.run_id,
                    "tenant_id": dl.tenant_id,
                    "partition": dl.record.partition,
                    "offset": dl.record.offset,
                },
            )
        if self.cache is not None and (effects.cache_writes or effects.cache_forgets):
            with self.step("cache write"):
                if effects.cache_writes:
                    ok = await self.cache.write(effects.cache_writes)
                    m.cache.labels("write" if ok else "write_error").inc(len(effects.cache_writes))
                if effects.cache_forgets:
                    await self.cache.forget(effects.cache_forgets)
        if applied.outbox_ids:
            with self.step("outbox publish"):
                await self.relay.publish(applied.outbox_ids)

    def decode_batch(
        self, batch: dict[PartitionKey, list[Any]], read_from: dict[PartitionKey, int]
    ) -> Batch:
        """Decode every record, each with the consumer's position when it was read (the
        batch's starting position for the first, the previous record's next offset for
        the others)."""
        out: Batch = {}
        for tp, records in batch.items():
            position = read_from.get(tp)
            decoded = []
            for r in records:
                value = decode(
                    r.value,
                    key=r.key,
                    max_state_bytes=self.max_state_bytes,
                    max_record_bytes=self.max_record_bytes,
                )
                if self.bind is not None:
                    value = self.bind(r.topic, value)
                headers = tuple(r.headers or ())
                decoded.append(
                    Incoming(
                        r.topic, r.partition, r.offset, r.key, r.value, value, headers, position
                    )
                )
                position = r.offset + 1
            out[tp] = decoded
        return out

    async def commit_or_isolate(
        self, cluster_id: str, batch: Batch, prepared: PreparedT
    ) -> list[Committed[EffectsT]]:
        """Apply a batch. Unless the failure is the server's (a retriable StorageError:
        the runtime pauses and retries), apply its records one by one and dead-letter
        the one that fails alone — refused by PostgreSQL (``storage_rejected``) or any
        other error (``internal_error``) — so no record can stop a partition."""
        try:
            return [await self._transaction(cluster_id, batch, prepared)]
        except Exception as exc:  # noqa: BLE001 - isolated below, retriable ones re-raised
            reraise_retriable(exc)
            log.warning(
                "a batch failed; applying its records one by one",
                extra={
                    "action": "isolate_batch",
                    "consumer": self.name,
                    "error": failure_text(exc),
                },
            )
        return [
            await self._commit_alone(cluster_id, tp, record, prepared)
            for tp, records in batch.items()
            for record in records
        ]

    async def _transaction(
        self, cluster_id: str, batch: Batch, prepared: PreparedT
    ) -> Committed[EffectsT]:
        started = time.perf_counter()
        with self.step("transaction"):
            applied = await self.store.transact(cluster_id, batch, prepared)
            exemplar = tracing.exemplar() if self.tracer is not None else None
        self.metrics.transaction_seconds.labels(self.name).observe(
            time.perf_counter() - started, exemplar
        )
        return applied

    async def _commit_alone(
        self, cluster_id: str, tp: PartitionKey, record: Incoming, prepared: PreparedT
    ) -> Committed[EffectsT]:
        try:
            return await self._transaction(cluster_id, {tp: [record]}, prepared)
        except Exception as exc:  # noqa: BLE001 - dead-lettered below
            reraise_retriable(exc)
            if isinstance(record.decoded, Rejection):  # its dead letter is what failed
                return await self._last_resort(cluster_id, tp, record, failure_text(exc))
            reason = (
                RejectReason.STORAGE_REJECTED
                if isinstance(exc, errors.StorageError)
                else RejectReason.INTERNAL_ERROR
            )
            failure = failure_text(exc)
        rejected = as_rejected(record, reason, failure)
        try:
            return await self._transaction(cluster_id, {tp: [rejected]}, prepared)
        except Exception as exc:  # noqa: BLE001 - the last resort below
            reraise_retriable(exc)
            return await self._last_resort(cluster_id, tp, rejected, failure_text(exc))

    async def _last_resort(
        self, cluster_id: str, tp: PartitionKey, record: Incoming, failure: str
    ) -> Committed[EffectsT]:
        """Even the dead-letter row was refused: move the partition past the record, send
        the record to the dead-letter topic directly, log it whole and count it
        (``alma_dead_letter_failures_total`` raises an alert). Nothing is lost: the
        bytes are in the dead-letter topic (or, if that fails too, in the log), and the
        record stays at its offset in the source topic."""
        progress, any_left = await self.store.skip(cluster_id, {tp: [record]})
        if not any_left:
            return Committed(progress)  # already past it (a redelivery): nothing to do
        assert isinstance(record.decoded, Rejection)
        letter = dead_letter_for(record, record.decoded)
        headers = {**dead_letter_headers(self.name, letter), "alma.dead_letter_stored": "false"}
        sent = await self.relay.send_now(
            self.store.dlq_topic,
            record.key,
            record.value or b"",
            [(k, str(v)) for k, v in headers.items() if v is not None],
        )
        self.metrics.dead_letter_failures.labels(self.name).inc()
        self.metrics.dead_letters.labels(self.name, letter.reason).inc()
        log.error(
            "a dead letter could not be stored; the partition moves past it",
            extra={
                "action": "dead_letter_unstorable",
                "consumer": self.name,
                "reason": letter.reason,
                "error": failure[:500],
                "topic": record.topic,
                "partition": record.partition,
                "offset": record.offset,
                "sent_to_dead_letter_topic": sent,
                "key_base64": base64.b64encode(record.key or b"").decode(),
                "value_base64": base64.b64encode(record.value or b"").decode(),
            },
        )
        return Committed(progress)


def partition_groups(batch: Batch, n: int) -> list[Batch]:
    """``batch`` split into at most ``n`` groups of whole partitions, of about equal
    record counts (largest first, each to the smallest group): the transactions a batch
    runs at once. Partitions that share a run (events published without a key, or
    keyed by the run id under another partition count) stay in one group: a run is
    never in two of a batch's transactions, which could both create it (a row that
    does not exist yet cannot be locked)."""
    if n <= 1:
        return [batch]
    parts = [tp for tp, records in batch.items() if records]
    owner: dict[PartitionKey, PartitionKey] = {tp: tp for tp in parts}

    def root(tp: PartitionKey) -> PartitionKey:
        while owner[tp] != tp:
            owner[tp] = owner[owner[tp]]
            tp = owner[tp]
        return tp

    first_seen: dict[tuple[str, str], PartitionKey] = {}
    for tp in parts:
        for record in batch[tp]:
            decoded = record.decoded
            if isinstance(decoded, Rejection):
                continue
            seen = first_seen.setdefault((decoded.tenant_id, decoded.run_id), tp)
            owner[root(tp)] = root(seen)
    components: dict[PartitionKey, list[PartitionKey]] = {}
    for tp in parts:
        components.setdefault(root(tp), []).append(tp)
    bundles = sorted(
        components.values(), key=lambda tps: (-sum(len(batch[tp]) for tp in tps), min(tps))
    )
    groups: list[Batch] = [{} for _ in range(max(1, min(n, len(bundles))))]
    sizes = [0] * len(groups)
    for tps in bundles:
        smallest = sizes.index(min(sizes))
        for tp in tps:
            groups[smallest][tp] = batch[tp]
            sizes[smallest] += len(batch[tp])
    return groups


def as_rejected(record: Incoming, reason: RejectReason, failure: str) -> Incoming:
    """``record`` as a rejection to dead-letter, with the ids its decoding found."""
    decoded = record.decoded
    return replace(
        record,
        decoded=Rejection(
            reason,
            failure[:500],
            event_id=getattr(decoded, "event_id", None),
            run_id=getattr(decoded, "run_id", None),
            tenant_id=getattr(decoded, "tenant_id", None),
        ),
    )


def reraise_retriable(exc: Exception) -> None:
    """The server's failures are retried by the runtime, never dead-lettered."""
    if isinstance(exc, errors.AlmaError) and exc.retriable:
        raise exc


def failure_text(exc: BaseException) -> str:
    return exc.message if isinstance(exc, errors.AlmaError) else repr(exc)
