"""Per-tenant settings (table ``tenant_settings``): a tenant's own rate quota where it
differs from the global ALMA_TENANT_RATE / ALMA_TENANT_BURST, whether the learner
learns from its runs, and how long its closed runs' checkpoints are kept (a NULL
column: the global value). Written by ``alma tenants set``; read by the checkpointer
(quotas) and the learner every :data:`REFRESH_S` seconds, and by each pruning round
(:mod:`alma_core.storage.retention`), so a change takes effect without a restart."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from alma_core.quotas import Quota

REFRESH_S = 5.0  # a change takes effect within this (plus one batch)


@dataclass(frozen=True)
class TenantSettings:
    tenant_id: str
    rate_per_s: float | None = None
    burst: int | None = None
    learner: bool | None = None  # None: the global setting (on)
    checkpoint_retention_days: float | None = None  # 0: forever
    updated_at: datetime | None = None

    def quota(self, default: Quota) -> Quota:
        """This tenant's quota: its own values, the global ones where it has none."""
        return Quota(
            default.rate if self.rate_per_s is None else self.rate_per_s,
            default.burst if self.burst is None else self.burst,
        )

    def retention_days(self, default: float) -> float:
        """Days this tenant's closed runs' checkpoints are kept (0: forever): its own,
        the global one where it has none."""
        own = self.checkpoint_retention_days
        return default if own is None else own

    @property
    def learns(self) -> bool:
        """Whether the learner learns from this tenant's finished runs."""
        return self.learner is not False


_COLUMNS = "tenant_id, rate_per_s, burst, learner, checkpoint_retention_days, updated_at"


async def load_all(conn: asyncpg.Connection | asyncpg.Pool) -> list[TenantSettings]:
    rows = await conn.fetch(f"SELECT {_COLUMNS} FROM tenant_settings ORDER BY tenant_id")
    return [TenantSettings(**dict(r)) for r in rows]


async def load(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str) -> TenantSettings:
    """``tenant_id``'s settings (all global when it has none of its own)."""
    row = await conn.fetchrow(
        f"SELECT {_COLUMNS} FROM tenant_settings WHERE tenant_id = $1", tenant_id
    )
    return TenantSettings(**dict(row)) if row else TenantSettings(tenant_id)


async def store(
    conn: asyncpg.Connection | asyncpg.Pool,
    tenant_id: str,
    *,
    rate_per_s: float | None,
    burst: int | None,
    learner: bool | None = None,
    checkpoint_retention_days: float | None = None,
) -> TenantSettings:
    """Set ``tenant_id``'s own values (None: the global one); all None removes its row."""
    own = (rate_per_s, burst, learner, checkpoint_retention_days)
    if all(value is None for value in own):
        await conn.execute("DELETE FROM tenant_settings WHERE tenant_id = $1", tenant_id)
        return TenantSettings(tenant_id)
    row = await conn.fetchrow(
        f"""INSERT INTO tenant_settings
              (tenant_id, rate_per_s, burst, learner, checkpoint_retention_days)
            VALUES ($1, $2, $3, $4, $5)
            ON CONFLICT (tenant_id) DO UPDATE
               SET rate_per_s = $2, burst = $3, learner = $4,
                   checkpoint_retention_days = $5, updated_at = now()
            RETURNING {_COLUMNS}""",
        tenant_id,
        *own,
    )
    return TenantSettings(**dict(row))


@dataclass(frozen=True)
class TenantUsage:
    """What a tenant holds in PostgreSQL now (:func:`usage`). ``state_bytes``: its
    checkpoints' states as stored (compressed where PostgreSQL compressed them), the
    bulk of what a tenant's runs take."""

    runs: int
    open_runs: int
    checkpoints: int
    state_bytes: int
    events: int
    dead_letters: int
    outcomes: int
    memories: int


async def usage(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str) -> TenantUsage:
    """``tenant_id``'s rows in each table that grows with its traffic, and its states'
    stored bytes: one statement, each count over the tenant's own index range (it reads
    every checkpoint of the tenant's: seconds for millions)."""
    row = await conn.fetchrow(
        """SELECT
             (SELECT count(*) FROM runs WHERE tenant_id = $1) AS runs,
             (SELECT count(*) FROM runs WHERE tenant_id = $1 AND completed_at IS NULL)
               AS open_runs,
             (SELECT count(*) FROM checkpoints WHERE tenant_id = $1) AS checkpoints,
             (SELECT coalesce(sum(pg_column_size(state)), 0) FROM checkpoints
              WHERE tenant_id = $1) AS state_bytes,
             (SELECT count(*) FROM run_events WHERE tenant_id = $1) AS events,
             (SELECT count(*) FROM dead_letters WHERE tenant_id = $1) AS dead_letters,
             (SELECT count(*) FROM workflow_outcomes WHERE tenant_id = $1) AS outcomes,
             (SELECT count(*) FROM memories WHERE tenant_id = $1) AS memories""",
        tenant_id,
    )
    assert row is not None
    return TenantUsage(**{k: int(v) for k, v in dict(row).items()})


def quotas(rows: list[TenantSettings], default: Quota) -> dict[str, Quota]:
    return {r.tenant_id: r.quota(default) for r in rows}


def not_learning(rows: list[TenantSettings]) -> frozenset[str]:
    """The tenants whose runs the learner passes by."""
    return frozenset(r.tenant_id for r in rows if not r.learns)
