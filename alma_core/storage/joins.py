"""PostgresJoinStore: merge requests handed on by the checkpointer become merged
checkpoints and replies, exactly once, in one transaction per batch.

* Offsets fenced as for the checkpointer (:mod:`alma_core.storage.offsets`).
* ``joins`` (run_id, join_id) remembers every answer: a join delivered again
  gets the very same reply again (same bytes) and no second checkpoint.
* The reply is an outbox row written with the merged checkpoint, published
  after commit (guarantee 3: an ``ok`` reply is only ever sent for a durable
  checkpoint); a reply lost to a crash is published by the outbox sweep.
* An error (missing branch, unknown reducer, strict conflict, too large)
  answers ``status: "error"`` and is dead-lettered with its reason.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg

from alma_core import errors, joining
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.sequencing import MAIN, Head, canonical_json
from alma_core.storage import offsets
from alma_core.storage.batches import (
    RUN_SEQ_HEADER,
    BatchStore,
    DeadLetter,
    Incoming,
    OutboxRow,
    dead_letter_for,
    insert_outbox,
    record_dead_letter,
)
from alma_core.storage.offsets import TopicPartition
from alma_core.types import Checkpoint
from schemas.decoder import Rejection
from schemas.events import BranchJoin, MergeReply


@dataclass(frozen=True)
class JoinConfig:
    group_id: str
    consumer: str
    reply_topic: str
    dlq_topic: str
    max_state_bytes: int


@dataclass
class JoinBatchResult:
    checkpoints: list[Checkpoint] = field(default_factory=list)
    outbox_ids: list[int] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    seeks: dict[TopicPartition, int] = field(default_factory=dict)
    next_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    outcomes: Counter[str] = field(default_factory=Counter)
    merge_seconds: list[float] = field(default_factory=list)
    already_applied: int = 0


def reply_bytes(reply: dict[str, Any]) -> bytes:
    """Canonical JSON, so a reply sent again is byte for byte the first one."""
    return canonical_json(reply).encode()


class PostgresJoinStore(BatchStore):
    def __init__(self, pool: asyncpg.Pool, config: JoinConfig, registry: ReducerRegistry) -> None:
        super().__init__(pool, config.group_id, dlq_topic=config.dlq_topic)
        self.config = config
        self.registry = registry

    async def apply(
        self, cluster_id: str, batch: dict[TopicPartition, list[Incoming]]
    ) -> JoinBatchResult:
        return await self.in_transaction(
            "applying joins", lambda conn: self._apply(conn, cluster_id, batch)
        )

    async def _apply(
        self, conn: asyncpg.Connection, cluster_id: str, batch: dict[TopicPartition, list[Incoming]]
    ) -> JoinBatchResult:
        result = JoinBatchResult()
        fenced = await offsets.fence(conn, self.config.group_id, cluster_id, batch)
        result.seeks, result.next_offsets = fenced.seeks, fenced.next_offsets
        result.already_applied = fenced.already_applied
        records = [r for rs in fenced.todo.values() for r in rs]
        run_ids = sorted({r.decoded.run_id for r in records if isinstance(r.decoded, BranchJoin)})
        if run_ids:
            await conn.execute(  # lock the runs in one order: no deadlock with the checkpointer
                "SELECT 1 FROM runs WHERE run_id = ANY($1::text[]) ORDER BY run_id FOR UPDATE",
                run_ids,
            )
        outbox: list[OutboxRow] = []
        for record in records:
            if isinstance(record.decoded, Rejection):
                result.dead_letters.append(dead_letter_for(record, record.decoded))
                continue
            if isinstance(record.decoded, BranchJoin):
                await self._join(conn, record, record.decoded, result, outbox)
        for dl in result.dead_letters:
            outbox.append(
                await record_dead_letter(conn, self.config.consumer, self.config.dlq_topic, dl)
            )
        result.outbox_ids = await insert_outbox(conn, outbox)
        ends = await offsets.advance(conn, self.config.group_id, cluster_id, fenced.todo)
        result.next_offsets.update(ends)
        return result

    async def _join(
        self,
        conn: asyncpg.Connection,
        record: Incoming,
        event: BranchJoin,
        result: JoinBatchResult,
        outbox: list[OutboxRow],
    ) -> None:
        payload = event.payload
        topic = payload.reply_to or self.config.reply_topic
        headers = json.dumps([["alma.join_id", payload.join_id]])
        known = await conn.fetchval(
            "SELECT reply FROM joins WHERE run_id = $1 AND join_id = $2",
            event.run_id, payload.join_id,
        )  # fmt: skip
        if known is not None:
            result.outcomes["duplicate"] += 1
            outbox.append((topic, event.run_id.encode(), reply_bytes(known), headers))
            return
        reply: dict[str, Any] = {"join_id": payload.join_id, "run_id": event.run_id,
                                 "tenant_id": event.tenant_id}  # fmt: skip
        started = time.perf_counter()
        try:
            run = await conn.fetchrow(
                "SELECT tenant_id, workflow_id, last_seq FROM runs WHERE run_id = $1",
                event.run_id,
            )
            if run is None or run["tenant_id"] != event.tenant_id:
                raise errors.MissingBranch(f"run {event.run_id!r} is unknown for this tenant")
            await self._check_position(conn, event.run_id, record.header_int(RUN_SEQ_HEADER))
            heads = await self._heads(conn, event.run_id)
            merged = joining.merge(
                payload,
                main=heads.get(MAIN),
                branches={k: h for k, h in heads.items() if k != MAIN},
                registered=await self._registered(conn, run["tenant_id"], run["workflow_id"]),
                registry=self.registry,
                max_state_bytes=self.config.max_state_bytes,
            )
        except errors.RejectedEvent as exc:
            result.merge_seconds.append(time.perf_counter() - started)
            result.outcomes["error"] += 1
            reply.update(status="error", error=f"{exc.reason}: {exc.message}")
            result.dead_letters.append(dead_letter_for(record, exc))
        else:
            result.merge_seconds.append(time.perf_counter() - started)
            result.outcomes["ok"] += 1
            checkpoint = await self._write_merge(conn, event, run["last_seq"] + 1, heads, merged)
            result.checkpoints.append(checkpoint)
            reply.update(status="ok", merged_state=merged.state, checkpoint_seq=checkpoint.seq)
        MergeReply.model_validate(reply)  # the reply we send keeps our own contract
        await conn.execute(
            """INSERT INTO joins (run_id, join_id, tenant_id, event_id, status, checkpoint_seq,
                                  reply)
               VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)""",
            event.run_id, payload.join_id, event.tenant_id, event.event_id, reply["status"],
            reply.get("checkpoint_seq"), canonical_json(reply),
        )  # fmt: skip
        outbox.append((topic, event.run_id.encode(), reply_bytes(reply), headers))

    @staticmethod
    async def _check_position(conn: asyncpg.Connection, run_id: str, position: int | None) -> None:
        """The join is merged at its place in the partition: every checkpoint after its
        position must be a merge of an earlier join (the joiner takes joins in partition
        order). A node's checkpoint there means events after the join were applied
        first, and a merge now would fold them in and take a seq after theirs."""
        if position is None:  # a hand-off from before the header existed
            return
        later = await conn.fetchval(
            """SELECT min(seq) FROM checkpoints
               WHERE run_id = $1 AND seq > $2 AND kind <> 'merge'""",
            run_id, position,
        )  # fmt: skip
        if later is not None:
            raise errors.RunMovedPastJoin(
                f"the run was at seq {position} at the join, and seq {later} (a later event) "
                "was applied before the merge: publish a run's next events only after its "
                "merge reply (the SDK's merge() waits for it)"
            )

    async def _heads(self, conn: asyncpg.Connection, run_id: str) -> dict[str, Head]:
        rows = await conn.fetch(
            """SELECT h.branch_key, h.seq, h.state_hash, c.state FROM run_heads h
               JOIN checkpoints c ON c.run_id = h.run_id AND c.seq = h.seq
               WHERE h.run_id = $1""",
            run_id,
        )
        return {r["branch_key"]: Head(r["seq"], r["state_hash"], r["state"]) for r in rows}

    async def _registered(
        self, conn: asyncpg.Connection, tenant_id: str, workflow_id: str
    ) -> ReducerConfig | None:
        config = await conn.fetchval(
            "SELECT config FROM reducer_configs WHERE tenant_id = $1 AND workflow_id = $2",
            tenant_id, workflow_id,
        )  # fmt: skip
        return ReducerConfig.from_json(config) if config is not None else None

    async def _write_merge(
        self,
        conn: asyncpg.Connection,
        event: BranchJoin,
        seq: int,
        heads: dict[str, Head],
        merged: joining.Merge,
    ) -> Checkpoint:
        now = datetime.now(UTC)
        main = heads.get(MAIN)
        metadata = {"join_id": event.payload.join_id}
        await conn.execute(
            """INSERT INTO checkpoints (run_id, seq, tenant_id, kind, node_id, branch_id,
                   parent_seq, event_id, state, state_hash, size_bytes, merged_from, metadata,
                   created_at)
               VALUES ($1, $2, $3, 'merge', $4, NULL, $5, $6, $7::jsonb, $8, $9, $10, $11::jsonb,
                       $12)""",
            event.run_id, seq, event.tenant_id, event.node_id, main.seq if main else None,
            event.event_id, merged.state_json, merged.state_hash, merged.size_bytes,
            list(merged.merged_from) or None, metadata, now,
        )  # fmt: skip
        await conn.execute(
            """INSERT INTO run_heads (run_id, branch_key, seq, state_hash) VALUES ($1, '', $2, $3)
               ON CONFLICT (run_id, branch_key) DO UPDATE
               SET seq = EXCLUDED.seq, state_hash = EXCLUDED.state_hash""",
            event.run_id, seq, merged.state_hash,
        )  # fmt: skip
        await conn.execute(
            "UPDATE runs SET last_seq = $2, updated_at = now() WHERE run_id = $1",
            event.run_id, seq,
        )  # fmt: skip
        return Checkpoint(
            run_id=event.run_id, tenant_id=event.tenant_id, seq=seq, state=merged.state,
            state_hash=merged.state_hash, size_bytes=merged.size_bytes, kind="merge",
            node_id=event.node_id, parent_seq=main.seq if main else None,
            event_id=event.event_id, merged_from=merged.merged_from, metadata=metadata,
            created_at=now,
        )  # fmt: skip
