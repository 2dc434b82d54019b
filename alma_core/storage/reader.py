"""The resume API: where a crashed run picks up. PostgreSQL says which checkpoints are
the heads; Redis serves those it holds at those seqs, PostgreSQL the rest.

Every read is scoped to one tenant (docs/guarantees.md §6): a run of another tenant is
"not found", from the cache and from PostgreSQL alike. A reader built without
a tenant is an operator's reader and exists only when multi-tenant mode is off.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import asyncpg

from alma_core import errors, joining
from alma_core.reducers import ReducerConfig
from alma_core.schemas.events import BranchJoinPayload
from alma_core.storage import reducer_configs, runs
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.cache_entries import cache_entries, checkpoint_from_doc, field_for
from alma_core.storage.observer import ReadMetrics, ReadObserver
from alma_core.storage.postgres import is_storage_failure, storage_error
from alma_core.types import BlockingLetter, Checkpoint

_COLUMNS = """run_id, tenant_id, seq, kind, node_id, branch_id, parent_seq, event_id, state,
              state_hash, size_bytes, merged_from, metadata, created_at"""
_C_COLUMNS = ", ".join(f"c.{column.strip()}" for column in _COLUMNS.split(","))


@dataclass(frozen=True)
class MergeParts:
    """A merged checkpoint and what went into it (:meth:`CheckpointReader.merge_parts`)."""

    merged: Checkpoint
    before: Checkpoint | None  # the main line's head it was applied onto
    branches: list[Checkpoint]  # in the join's order
    request: dict[str, Any]  # the branch.join payload, as the audit log keeps it
    registered: ReducerConfig | None  # the workflow's reducers as registered now

    def config(self) -> ReducerConfig:
        """The reducers the merge used: the request's, falling back to the workflow's."""
        payload = BranchJoinPayload.model_validate(self.request)
        return joining.config_for(payload, self.registered)

    def inputs(self) -> list[tuple[str, dict[str, Any]]]:
        """Each input of the merge, labelled: a branch by its id and seq, a given state
        by its index."""
        if self.request.get("states") is not None:
            return [(f"states[{i}]", s) for i, s in enumerate(self.request["states"])]
        ids = self.request.get("branch_ids") or []
        return [(f"{b}@{cp.seq}", cp.state) for b, cp in zip(ids, self.branches, strict=False)]


class CheckpointReader:
    """Reads of one tenant's checkpoints. Each cache lookup is reported to ``observer``
    (default: this process's :class:`~alma_core.storage.observer.ReadMetrics`).

    **Never older than PostgreSQL.** A checkpoint changes only when its run moves to a
    new projection (``alma replay --apply``: same seq, new state and hash), so a cached
    one is right exactly when its seq and hash are still its branch's head's. Every
    read of heads asks PostgreSQL which seqs and hashes are the heads (``run_heads``: no
    states) and takes from Redis only the entries that match; the others come from
    PostgreSQL and are cached. An entry a writer never replaced (a member killed
    between its commit and its cache write, a lost write, Redis restored from an
    older snapshot, checkpoints deleted by retention) is never served, and a reader
    reads its own writes.

    **One projection per answer.** Each read of a run's checkpoints is one statement
    (one snapshot); a heads read that took some heads from Redis and finds the others
    changed projection meanwhile reads them all again in one statement."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        cache: RedisCheckpointCache | None,
        *,
        tenant_id: str | None,
        require_tenant: bool = True,
        observer: ReadObserver | None = None,
    ) -> None:
        if require_tenant and not tenant_id:
            raise errors.ContextError(
                "a tenant is required to read checkpoints (ALMA_REQUIRE_TENANT=true); "
                "pass --tenant / tenant_id"
            )
        self.pool = pool
        self.cache = cache
        self.tenant_id = tenant_id
        self.observer = observer or ReadMetrics.shared()

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        try:
            rows: list[asyncpg.Record] = await self.pool.fetch(sql, *args)
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, "reading checkpoints") from exc
            raise
        return rows

    async def _tenant_of(self, run_id: str) -> str | None:
        """The tenant whose run this is: the reader's, or (an operator's reader, with no
        tenant) the only tenant with a run of this id. None: there is no such run."""
        if self.tenant_id is not None:
            return self.tenant_id
        rows = await self._fetch("SELECT tenant_id FROM runs WHERE run_id = $1", run_id)
        tenants = sorted(r["tenant_id"] for r in rows)
        if len(tenants) > 1:
            raise errors.ContextError(
                f"tenants {', '.join(tenants)} each have a run {run_id!r}: pass its tenant"
            )
        return tenants[0] if tenants else None

    async def _head_seqs(self, tenant_id: str, run_id: str) -> dict[str | None, tuple[int, str]]:
        """The run's current heads by branch (None: the main line), their seqs and state
        hashes, from PostgreSQL."""
        rows = await self._fetch(
            """SELECT branch_key, seq, state_hash FROM run_heads
               WHERE tenant_id = $1 AND run_id = $2""",
            tenant_id,
            run_id,
        )
        return {(r["branch_key"] or None): (r["seq"], r["state_hash"]) for r in rows}

    async def _cached(
        self, tenant_id: str, run_id: str, fields: list[str] | None
    ) -> dict[str, dict[str, Any]]:
        """The cache's entries for ``fields`` (None: all the run's), a failed lookup
        counted and empty."""
        if self.cache is None:
            return {}
        try:
            return await self.cache.entries(tenant_id, run_id, fields)
        except errors.CacheError:
            self.observer.cache_read("error")
            return {}

    async def _heads(
        self, run_id: str, wanted: set[str | None] | None = None
    ) -> dict[str | None, Checkpoint]:
        """The current heads (those in ``wanted``, or all): each from the cache when the
        cache holds it at its current seq, else from PostgreSQL (then cached). The two
        lookups run at once: a read costs the slower of them, not their sum."""
        tenant_id = await self._tenant_of(run_id)
        if tenant_id is None:
            return {}
        if self.cache is None:
            return await self._heads_from_db(tenant_id, run_id, wanted)
        fields = None if wanted is None else [field_for(b) for b in wanted]
        seqs, cached = await asyncio.gather(
            self._head_seqs(tenant_id, run_id), self._cached(tenant_id, run_id, fields)
        )
        if wanted is not None:
            seqs = {b: s for b, s in seqs.items() if b in wanted}
        if not seqs:
            return {}
        heads: dict[str | None, Checkpoint] = {}
        missing: dict[str | None, tuple[int, str]] = {}
        for branch, (seq, digest) in seqs.items():
            doc = cached.get(field_for(branch))
            if (
                doc is not None
                and doc.get("seq") == seq
                and doc.get("state_hash") == digest
                and doc.get("tenant_id") == tenant_id
            ):
                heads[branch] = checkpoint_from_doc(doc)
            else:
                missing[branch] = (seq, digest)
        self.observer.cache_read("miss" if missing else "hit")
        if not missing:
            return heads
        found = await self._by_seq(tenant_id, run_id, [seq for seq, _ in missing.values()])
        if any(cp.state_hash != missing.get(cp.branch_id, (0, cp.state_hash))[1] for cp in found):
            # the run moved to another projection between the two reads: read its heads
            # again in one statement, all of one projection
            return await self._heads_from_db(tenant_id, run_id, wanted)
        heads.update({cp.branch_id: cp for cp in found})
        await self._fill(found, complete=wanted is None and len(found) == len(missing))
        return heads

    async def _heads_from_db(
        self, tenant_id: str, run_id: str, wanted: set[str | None] | None
    ) -> dict[str | None, Checkpoint]:
        """Without a cache: the heads and their checkpoints in one query."""
        rows = await self._fetch(
            f"""SELECT {_C_COLUMNS} FROM run_heads h JOIN checkpoints c
                  ON c.tenant_id = h.tenant_id AND c.run_id = h.run_id AND c.seq = h.seq
                WHERE h.tenant_id = $1 AND h.run_id = $2""",
            tenant_id,
            run_id,
        )
        heads = {r["branch_id"]: checkpoint_from_doc(r) for r in rows}
        return heads if wanted is None else {b: cp for b, cp in heads.items() if b in wanted}

    async def _by_seq(self, tenant_id: str, run_id: str, seqs: list[int]) -> list[Checkpoint]:
        rows = await self._fetch(
            f"""SELECT {_COLUMNS} FROM checkpoints
                WHERE tenant_id = $1 AND run_id = $2 AND seq = ANY($3::bigint[])""",
            tenant_id,
            run_id,
            seqs,
        )
        return [checkpoint_from_doc(r) for r in rows]

    async def _fill(self, found: list[Checkpoint], *, complete: bool) -> None:
        if self.cache is None or not found:
            return
        try:
            await self.cache.put(
                cache_entries({cp.branch_id: cp for cp in found}), complete=complete
            )
        except errors.CacheError:
            self.observer.cache_read("error")

    async def latest(self, run_id: str) -> Checkpoint | None:
        """The run's newest checkpoint (highest seq, any branch)."""
        heads = await self._heads(run_id)
        return max(heads.values(), key=lambda cp: cp.seq) if heads else None

    async def branch_heads(self, run_id: str) -> dict[str | None, Checkpoint]:
        """The head of every branch of the run; the main line under ``None``."""
        return await self._heads(run_id)

    async def status(self, run_id: str) -> str | None:
        """The run's status (``running``, ``succeeded``, ``failed``); None when no event
        of it was applied (a run not started, or another tenant's)."""
        tenant_id = await self._tenant_of(run_id)
        rows = await self._fetch(
            "SELECT status FROM runs WHERE tenant_id = $1 AND run_id = $2", tenant_id, run_id
        )
        return str(rows[0]["status"]) if rows else None

    async def blocked_by(self, run_id: str) -> list[BlockingLetter]:
        """The dead letters of the run's events that block it, oldest first: none for a
        run that is not blocked (docs/guarantees.md §11)."""
        tenant_id = await self._tenant_of(run_id)
        if tenant_id is None:
            return []
        try:
            rows = await runs.blocking_letters(self.pool, tenant_id, run_id)
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, "reading a run's dead letters") from exc
            raise
        return [
            BlockingLetter(r["id"], r["reason"], r["detail"], r["event_id"], r["created_at"])
            for r in rows
        ]

    async def workflow_of(self, run_id: str) -> str | None:
        """The workflow the run belongs to; None when no event of it was applied."""
        tenant_id = await self._tenant_of(run_id)
        rows = await self._fetch(
            "SELECT workflow_id FROM runs WHERE tenant_id = $1 AND run_id = $2",
            tenant_id,
            run_id,
        )
        return str(rows[0]["workflow_id"]) if rows else None

    async def main_head(self, run_id: str) -> Checkpoint | None:
        return (await self._heads(run_id, {None})).get(None)

    async def history(
        self, run_id: str, *, limit: int = 100, before_seq: int | None = None
    ) -> list[Checkpoint]:
        """Checkpoints newest first, ``limit`` at most, below ``before_seq`` when given."""
        tenant_id = await self._tenant_of(run_id)
        rows = await self._fetch(
            f"""SELECT {_COLUMNS} FROM checkpoints
                WHERE tenant_id = $1 AND run_id = $2 AND ($3::bigint IS NULL OR seq < $3)
                ORDER BY seq DESC LIMIT $4""",
            tenant_id,
            run_id,
            before_seq,
            max(1, min(limit, 10_000)),
        )
        return [checkpoint_from_doc(r) for r in rows]

    async def get(self, run_id: str, seq: int) -> Checkpoint | None:
        return (await self.get_many(run_id, [seq])).get(seq)

    async def get_many(self, run_id: str, seqs: list[int]) -> dict[int, Checkpoint]:
        """The run's checkpoints at ``seqs`` (those it has), read in one statement: all
        of one projection."""
        tenant_id = await self._tenant_of(run_id)
        found = await self._by_seq(tenant_id, run_id, seqs) if tenant_id else []
        return {cp.seq: cp for cp in found}

    async def state_at(
        self, run_id: str, seq: int, branch_id: str | None = None
    ) -> Checkpoint | None:
        """The branch's state as it was at ``seq`` (the main line: ``None``): its newest
        checkpoint at or below that seq; None before its first (or no such run)."""
        tenant_id = await self._tenant_of(run_id)
        rows = await self._fetch(
            f"""SELECT {_COLUMNS} FROM checkpoints
                WHERE tenant_id = $1 AND run_id = $2 AND seq <= $3
                  AND branch_id IS NOT DISTINCT FROM $4
                ORDER BY seq DESC LIMIT 1""",
            tenant_id,
            run_id,
            seq,
            branch_id,
        )
        return checkpoint_from_doc(rows[0]) if rows else None

    async def merge_parts(self, run_id: str, seq: int) -> MergeParts | None:
        """A merged checkpoint with what made it: the main line before it, the branch
        checkpoints it folded, its join's request (from the audit log) and the reducers
        the workflow has registered now. None when ``seq`` is no merge of the run."""
        tenant_id = await self._tenant_of(run_id)
        rows = await self._fetch(
            f"""WITH m AS (SELECT seq, merged_from, parent_seq FROM checkpoints
                           WHERE tenant_id = $1 AND run_id = $2 AND seq = $3
                             AND kind = 'merge')
                SELECT {_C_COLUMNS}, CASE WHEN c.seq = m.seq THEN
                         (SELECT e.payload FROM run_events e
                          WHERE e.tenant_id = c.tenant_id AND e.run_id = c.run_id
                            AND e.event_id = c.event_id) END AS request
                FROM checkpoints c JOIN m ON c.seq = m.seq OR c.seq = ANY(m.merged_from)
                                          OR c.seq = m.parent_seq
                WHERE c.tenant_id = $1 AND c.run_id = $2""",
            tenant_id,
            run_id,
            seq,
        )
        by_seq = {r["seq"]: r for r in rows}
        if seq not in by_seq:
            return None
        merged = checkpoint_from_doc(by_seq[seq])
        found = {s: checkpoint_from_doc(r) for s, r in by_seq.items()}
        request = by_seq[seq]["request"]
        workflow = await self.workflow_of(run_id)
        registered = (
            await reducer_configs.load(self.pool, merged.tenant_id, workflow) if workflow else None
        )
        return MergeParts(
            merged=merged,
            before=found.get(merged.parent_seq or 0),
            branches=[found[s] for s in merged.merged_from if s in found],
            request=json.loads(request) if isinstance(request, str) else dict(request or {}),
            registered=registered,
        )
