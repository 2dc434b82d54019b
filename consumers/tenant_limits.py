"""What each tenant's own settings bound in a batch, read every
:data:`~alma_core.storage.tenant_settings.REFRESH_S` seconds before the batch's
transaction (the handler's ``prepare``), so that ``alma tenants set`` takes effect
without a restart: the tenants at their storage quota (the checkpointer refuses their
new runs, after reading their standing once more in the transaction), the tenants'
own state size limits (the checkpointer's and the joiner's states are held to them),
the tenants whose learner is off (the learner passes their runs by) and, for the
checkpointer's throttle, each tenant's own rate quota (one read for all of them); the
checkpointer's reader also counts each tenant's blocked runs (``alma_runs_blocked``).
PostgreSQL being away keeps what was read before (logged): the batch's own
transaction then says so."""

from __future__ import annotations

import logging
import time

import asyncpg

from alma_core import errors
from alma_core.consumers.metrics import Metrics
from alma_core.quotas import Quota, TenantLimits
from alma_core.storage import runs, tenant_settings
from alma_core.storage.batches import guarded

log = logging.getLogger("alma.consumers")


class LimitsReader:
    def __init__(
        self,
        pool: asyncpg.Pool,
        metrics: Metrics,
        *,
        max_state_bytes: int,
        storage_quota: int = 0,
        storage: bool = False,
        rate: Quota | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.max_state_bytes = max_state_bytes  # ALMA_MAX_STATE_BYTES: the ceiling
        self.storage_quota = storage_quota  # ALMA_TENANT_STORAGE_QUOTA_BYTES
        self.storage = storage  # read the storage standings too (the checkpointer)
        self.rate = rate  # ALMA_TENANT_RATE / _BURST, with tenant topics (the checkpointer)
        self.limits = TenantLimits()
        self._read_at: float | None = None
        self._blocked_tenants: set[str] = set()  # those alma_runs_blocked was set for

    async def current(self) -> TenantLimits:
        """The limits, read again once :data:`REFRESH_S` passed."""
        now = time.monotonic()
        if self._read_at is None or now - self._read_at >= tenant_settings.REFRESH_S:
            self._read_at = now
            try:
                self.limits = await self._read()
            except errors.StorageError as exc:
                log.warning(
                    "tenants' settings not read; the limits read before stay",
                    extra={"action": "tenant_settings_unread", "error": repr(exc)},
                )
        return self.limits

    async def _read(self) -> TenantLimits:
        rows = await guarded("reading tenants' settings", tenant_settings.load_all(self.pool))
        state_bytes = tenant_settings.state_limits(rows, self.max_state_bytes)
        off = tenant_settings.not_learning(rows)
        quotas = {} if self.rate is None else tenant_settings.quotas(rows, self.rate)
        if not self.storage:
            return TenantLimits(state_bytes=state_bytes, not_learning=off, quotas=quotas)
        standings = await guarded(
            "reading tenants' storage", tenant_settings.storage(self.pool, self.storage_quota)
        )
        for s in standings:
            self.metrics.tenant_storage.labels(s.tenant_id).set(s.used)
            self.metrics.tenant_storage_quota.labels(s.tenant_id).set(s.quota)
        full = frozenset(s.tenant_id for s in standings if s.full)
        await self._count_blocked()
        return TenantLimits(full, state_bytes, off, quotas)

    async def _count_blocked(self) -> None:
        """``alma_runs_blocked`` of every tenant, 0 for one whose runs are no longer."""
        blocked = await guarded("counting blocked runs", runs.blocked_counts(self.pool))
        for tenant in self._blocked_tenants - blocked.keys():
            self.metrics.runs_blocked.labels(tenant).set(0)
        for tenant, n in blocked.items():
            self.metrics.runs_blocked.labels(tenant).set(n)
        self._blocked_tenants |= blocked.keys()
