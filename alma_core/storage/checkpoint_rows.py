"""The checkpoint and head rows a batch writes, each statement written once: the first
two CTEs of the checkpointer's and the joiner's single write statement, at fixed
parameters ($1 to $19), so both statements begin with the same text and add their own
CTEs from $20 on (:func:`rows_args` gives their values).

Sibling data-modifying CTEs run on one snapshot; the foreign keys (a new run's
checkpoints and heads) are checked at the end of the statement, when its run row is
there. The checkpoints' sizes are counted to their tenants' kept bytes in the same
statement (:data:`COUNT_STORED`), so the count never parts from the rows."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from alma_core.schemas import jsoncodec
from alma_core.sequencing import CheckpointRow
from alma_core.storage.postgres import columns

# What a statement that writes checkpoints adds to their tenants' kept bytes (the
# ``tenant_storage`` counts their storage quotas read): one slot per writing backend
# (its pid modulo 64), so that two batches of a tenant seldom wait on one row, and those
# that do lock their tenants' rows in one order (by tenant: never a deadlock). A negative
# size takes away (retention's deletes, a replay's rewrite). ``source``: rows of
# (tenant, size).
COUNT_STORED = """
    INSERT INTO tenant_storage (tenant_id, slot, bytes)
    SELECT u.t, pg_backend_pid() % 64, sum(u.z)
    FROM {source} AS u(t, z) GROUP BY u.t ORDER BY u.t
    ON CONFLICT (tenant_id, slot) DO UPDATE SET bytes = tenant_storage.bytes + EXCLUDED.bytes"""

ROWS = (
    """
WITH new_checkpoints AS (
    INSERT INTO checkpoints (run_id, seq, tenant_id, kind, node_id, branch_id, parent_seq,
                             event_id, state, state_hash, size_bytes, merged_from, metadata,
                             created_at)
    SELECT u.r, u.s, u.t, u.k, u.n, u.b, u.p, u.e, u.state::json, u.h, u.z,
           u.mf::bigint[], u.m::jsonb, $14
    FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[],
                $6::text[], $7::bigint[], $8::text[], $9::text[], $10::text[],
                $11::int[], $12::text[], $13::text[]) AS u(r, s, t, k, n, b, p, e, state, h,
                                                          z, mf, m)
), new_heads AS (
    INSERT INTO run_heads (tenant_id, run_id, branch_key, seq, state_hash)
    SELECT * FROM unnest($15::text[], $16::text[], $17::text[], $18::bigint[], $19::text[])
    ON CONFLICT (tenant_id, run_id, branch_key) DO UPDATE
    SET seq = EXCLUDED.seq, state_hash = EXCLUDED.state_hash
), counted AS (
"""
    + COUNT_STORED.format(source="unnest($3::text[], $11::int[])")
    + """
)"""
)


def rows_args(
    checkpoints: Sequence[CheckpointRow],
    created_at: datetime,
    heads: Sequence[tuple[str, str, str, int, str]],
    merged_from: Sequence[tuple[int, ...]] | None = None,
) -> list[Any]:
    """ROWS' values, $1 to $19: the checkpoints (``merged_from``: each one's merged
    seqs, for merges), their creation time, and the heads (tenant, run, branch key, seq,
    state hash) to set."""
    cps = checkpoints
    merged = merged_from if merged_from is not None else [()] * len(cps)
    return [
        [c.run_id for c in cps],
        [c.seq for c in cps],
        [c.tenant_id for c in cps],
        [c.kind for c in cps],
        [c.node_id for c in cps],
        [c.branch_id for c in cps],
        [c.parent_seq for c in cps],
        [c.event_id for c in cps],
        [c.state_json for c in cps],
        [c.state_hash for c in cps],
        [c.size_bytes for c in cps],
        [_array(m) for m in merged],
        [None if c.metadata is None else jsoncodec.compact(c.metadata).decode() for c in cps],
        created_at,
        *columns(heads, 5),
    ]


def _array(seqs: tuple[int, ...]) -> str | None:
    """A bigint[] literal, or NULL for none (a checkpoint that merged nothing)."""
    return "{" + ",".join(str(s) for s in seqs) + "}" if seqs else None
