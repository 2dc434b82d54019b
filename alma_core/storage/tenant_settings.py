"""Per-tenant settings (table ``tenant_settings``): a tenant's own rate quota where it
differs from the global ALMA_TENANT_RATE / ALMA_TENANT_BURST, whether the learner
learns from its runs, how long its closed runs' checkpoints are kept, the bytes of
checkpoint states it may keep (its storage quota) and the bytes one state may take
(only lower than the global limit); a NULL column: the global value. Written by
``alma tenants set``; read by the checkpointer (quotas, limits), the joiner (limits)
and the learner every :data:`REFRESH_S` seconds, and by each pruning round
(:mod:`alma_core.storage.retention`), so a change takes effect without a restart."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from alma_core import errors, tenancy
from alma_core.quotas import Quota

REFRESH_S = 5.0  # a change takes effect within this (plus one batch)


@dataclass(frozen=True)
class TenantSettings:
    tenant_id: str
    rate_per_s: float | None = None
    burst: int | None = None
    learner: bool | None = None  # None: the global setting (on)
    checkpoint_retention_days: float | None = None  # 0: forever
    storage_quota_bytes: int | None = None  # 0: none
    max_state_bytes: int | None = None  # lower than the global limit, or it is the global
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

    def storage_quota(self, default: int) -> int:
        """Bytes of checkpoint states this tenant may keep (0: no limit): its own quota,
        the global one where it has none."""
        own = self.storage_quota_bytes
        return default if own is None else own

    def state_limit(self, default: int) -> int:
        """The bytes a checkpoint's state of this tenant may take: its own limit where it
        is lower than the global one (the ceiling), the global one otherwise."""
        own = self.max_state_bytes
        return default if own is None else min(own, default)

    @property
    def learns(self) -> bool:
        """Whether the learner learns from this tenant's finished runs."""
        return self.learner is not False


_COLUMNS = (
    "tenant_id, rate_per_s, burst, learner, checkpoint_retention_days, storage_quota_bytes, "
    "max_state_bytes, updated_at"
)


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
    storage_quota_bytes: int | None = None,
    max_state_bytes: int | None = None,
) -> TenantSettings:
    """Set ``tenant_id``'s own values (None: the global one); all None removes its row.
    A tenant id that can be no tenant, or a number that is not finite, raises
    ConfigError and stores nothing."""
    if problem := tenancy.tenant_problem(tenant_id):
        raise errors.ConfigError(problem)
    for name, number in (
        ("rate", rate_per_s),
        ("checkpoint retention days", checkpoint_retention_days),
    ):
        if number is not None and not (math.isfinite(number) and number >= 0):
            raise errors.ConfigError(
                f"{name} {number!r} for tenant {tenant_id!r}: give a finite number, 0 or "
                "more (0: no limit), or leave it out to keep the global one"
            )
    own = (
        rate_per_s,
        burst,
        learner,
        checkpoint_retention_days,
        storage_quota_bytes,
        max_state_bytes,
    )
    if all(value is None for value in own):
        await conn.execute("DELETE FROM tenant_settings WHERE tenant_id = $1", tenant_id)
        return TenantSettings(tenant_id)
    row = await conn.fetchrow(
        f"""INSERT INTO tenant_settings
              (tenant_id, rate_per_s, burst, learner, checkpoint_retention_days,
               storage_quota_bytes, max_state_bytes)
            VALUES ($1, $2, $3, $4, $5, $6, $7)
            ON CONFLICT (tenant_id) DO UPDATE
               SET rate_per_s = $2, burst = $3, learner = $4,
                   checkpoint_retention_days = $5, storage_quota_bytes = $6,
                   max_state_bytes = $7, updated_at = now()
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


async def known(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str) -> bool:
    """Whether ``tenant_id`` is a tenant here: it has settings of its own, a run, a
    dead letter or a bound PostgreSQL role (a name typed wrong has none of them)."""
    return bool(
        await conn.fetchval(
            """SELECT EXISTS (SELECT 1 FROM tenant_settings WHERE tenant_id = $1)
                   OR EXISTS (SELECT 1 FROM runs WHERE tenant_id = $1)
                   OR EXISTS (SELECT 1 FROM dead_letters WHERE tenant_id = $1)
                   OR EXISTS (SELECT 1 FROM tenant_roles WHERE tenant_id = $1)""",
            tenant_id,
        )
    )


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


@dataclass(frozen=True)
class StorageStanding:
    """A tenant's kept checkpoint bytes (as counted in ``tenant_storage``: the states'
    sizes as written, before PostgreSQL's compression) against its storage quota."""

    tenant_id: str
    used: int
    quota: int  # in effect: its own, else the global one; 0: none

    @property
    def full(self) -> bool:
        """At or over its quota: its new runs are refused."""
        return self.quota > 0 and self.used >= self.quota


async def storage(
    conn: asyncpg.Connection | asyncpg.Pool,
    default_quota: int,
    tenants: Collection[str] | None = None,
) -> list[StorageStanding]:
    """Each tenant's (each of ``tenants``, when given) kept bytes and quota in effect:
    the sum of its ``tenant_storage`` slots (at most 64 rows a tenant). A tenant that
    never kept a checkpoint has no row (its use is 0)."""
    rows = await conn.fetch(
        """SELECT u.tenant_id, u.used, coalesce(s.storage_quota_bytes, $1) AS quota
           FROM (SELECT tenant_id, sum(bytes)::bigint AS used FROM tenant_storage
                 WHERE $2::text[] IS NULL OR tenant_id = ANY($2::text[])
                 GROUP BY tenant_id) AS u
           LEFT JOIN tenant_settings s USING (tenant_id)
           ORDER BY u.tenant_id""",
        default_quota,
        None if tenants is None else sorted(tenants),
    )
    return [StorageStanding(r["tenant_id"], int(r["used"]), int(r["quota"])) for r in rows]


async def standing(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, default_quota: int
) -> StorageStanding:
    """``tenant_id``'s kept bytes against its quota (0 used where it keeps nothing)."""
    found = await storage(conn, default_quota, [tenant_id])
    if found:
        return found[0]
    own = await load(conn, tenant_id)
    return StorageStanding(tenant_id, 0, own.storage_quota(default_quota))


def quotas(rows: list[TenantSettings], default: Quota) -> dict[str, Quota]:
    return {r.tenant_id: r.quota(default) for r in rows}


def state_limits(rows: list[TenantSettings], default: int) -> dict[str, int]:
    """The tenants whose own state size limit is below the global ``default``."""
    return {r.tenant_id: r.state_limit(default) for r in rows if r.state_limit(default) < default}


def not_learning(rows: list[TenantSettings]) -> frozenset[str]:
    """The tenants whose runs the learner passes by."""
    return frozenset(r.tenant_id for r in rows if not r.learns)
