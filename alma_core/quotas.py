"""Rate quotas per tenant (pure): a token bucket per tenant that the checkpointer's
consumer asks before it handles a tenant's records; and the other limits a tenant's own
settings put on a batch (:class:`TenantLimits`).

Over its quota a tenant's records are **delayed, never dropped**: what the bucket does
not admit is put back (its partitions sought back to the first record not admitted) and
the tenant's partitions are paused until the bucket has refilled a chunk, so the fetches
meanwhile bring only the other tenants' records: a tenant's backlog never sits in front
of another's (this needs ALMA_TENANT_TOPICS, where each tenant has its own partitions;
on a shared topic one tenant's pause would hold back every run of its partitions).
A held-back tenant goes on one partition at a time (each such fetch brings one
partition's backlog, not all of them at once), and with all of them once its bucket is
full again (:meth:`TenantGate.full`).
Each run's order is kept: records of a partition are admitted from its front only.

A tenant's partitions may be spread over several members of the group: each member
enforces ``rate × share`` and ``burst × share``, ``share`` being the part of the
tenant's partitions it holds, so the group as a whole admits the tenant's rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

CHUNK_S = 0.1  # a throttled tenant is let in again once its bucket holds this much time


@dataclass(frozen=True)
class Quota:
    """``rate`` events per second (0: no limit) with ``burst`` events at once (0: one
    second's worth)."""

    rate: float = 0.0
    burst: int = 0

    @property
    def limited(self) -> bool:
        return self.rate > 0

    def scaled(self, share: float) -> tuple[float, float]:
        """(rate, burst) for a member holding ``share`` of the tenant's partitions."""
        burst = self.burst or self.rate
        return self.rate * share, max(1.0, burst * share)


@dataclass(frozen=True)
class TenantLimits:
    """What tenants' own settings bound in a batch, as a worker read them last
    (:mod:`alma_core.consumers.tenant_limits`): the tenants at their storage quota, whose
    new runs are refused, the tenants' own state size limits (below the global), the
    tenants whose learner is off, and each tenant's rate quota where it has its own (the
    checkpointer's throttle)."""

    full: frozenset[str] = frozenset()
    state_bytes: Mapping[str, int] = field(default_factory=dict)
    not_learning: frozenset[str] = frozenset()  # their learner off: their runs passed by
    quotas: Mapping[str, Quota] = field(default_factory=dict)


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class TenantGate:
    """The buckets of every tenant this member has seen; ``quotas`` per tenant, else
    ``default`` (the global setting)."""

    default: Quota = field(default_factory=Quota)
    quotas: dict[str, Quota] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def configure(self, default: Quota, quotas: dict[str, Quota]) -> None:
        """New quotas (settings changed): buckets keep what they hold, capped anew."""
        self.default, self.quotas = default, dict(quotas)

    def quota(self, tenant: str) -> Quota:
        return self.quotas.get(tenant, self.default)

    def limited(self, tenant: str) -> bool:
        return self.quota(tenant).limited

    def _refilled(self, tenant: str, share: float, now: float) -> tuple[_Bucket, float, float]:
        rate, burst = self.quota(tenant).scaled(share)
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(burst, now)
        bucket.tokens = min(burst, bucket.tokens + rate * max(0.0, now - bucket.at))
        bucket.at = now
        return bucket, rate, burst

    def admit(
        self, tenant: str, wanted: int, share: float, now: float, *, waiting: bool = False
    ) -> int:
        """How many of ``wanted`` records ``tenant`` may have handled now (all of them
        without a quota); they are taken from its bucket. ``waiting``: the tenant is held
        back already; it goes on by chunks (:data:`CHUNK_S` of its rate, or all it
        wants if less), not by the token or two that refilled since the last poll: a
        few fuller batches a second instead of one per poll, which every other
        tenant's poll would otherwise bring (each batch costs a transaction)."""
        if wanted <= 0 or not self.limited(tenant):
            return max(0, wanted)
        bucket, rate, burst = self._refilled(tenant, share, now)
        if waiting and bucket.tokens < min(wanted, _chunk(rate, burst)):
            return 0
        admitted = min(wanted, math.floor(bucket.tokens))
        bucket.tokens -= admitted
        return admitted

    def full(self, tenant: str, share: float, now: float) -> bool:
        """Whether ``tenant``'s bucket holds its whole burst (no quota: always): what
        it admitted lately it could have had at once, it is not over its quota."""
        if not self.limited(tenant):
            return True
        bucket, _, burst = self._refilled(tenant, share, now)
        return bucket.tokens >= burst

    def wait_s(self, tenant: str, share: float, now: float) -> float:
        """Seconds until ``tenant``'s bucket holds a chunk again (0: now)."""
        if not self.limited(tenant):
            return 0.0
        bucket, rate, burst = self._refilled(tenant, share, now)
        chunk = _chunk(rate, burst)
        if bucket.tokens >= chunk or rate <= 0:
            return 0.0
        return (chunk - bucket.tokens) / rate


def _chunk(rate: float, burst: float) -> float:
    """The tokens a held-back tenant goes on with: CHUNK_S of its rate (at least one)."""
    return max(1.0, min(burst, rate * CHUNK_S))
