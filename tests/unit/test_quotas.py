"""Rate quotas per tenant (pure): a tenant over its rate is admitted at its rate, in
bursts of at most its burst, never more; others are untouched; a member holding part of
a tenant's partitions admits that part of its rate."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from alma_core.quotas import Quota, TenantGate


def test_without_a_quota_everything_is_admitted() -> None:
    gate = TenantGate()
    assert gate.admit("acme", 10_000, 1.0, 0.0) == 10_000
    assert gate.wait_s("acme", 1.0, 0.0) == 0.0


def test_a_burst_then_the_rate() -> None:
    gate = TenantGate(Quota(rate=100, burst=50))
    assert gate.admit("acme", 500, 1.0, 0.0) == 50
    assert gate.admit("acme", 500, 1.0, 0.0) == 0
    assert gate.wait_s("acme", 1.0, 0.0) == 0.1  # a chunk: 0.1 s of its rate
    assert gate.admit("acme", 500, 1.0, 0.1) == 10
    assert gate.admit("acme", 500, 1.0, 10.0) == 50  # never more than the burst
    assert gate.admit("globex", 500, 1.0, 10.0) == 50  # its own bucket


def test_a_tenant_held_back_goes_on_by_chunks_not_by_the_token() -> None:
    gate = TenantGate(Quota(rate=100, burst=100))
    assert gate.admit("acme", 500, 1.0, 0.0) == 100  # its burst, then held back
    assert gate.admit("acme", 500, 1.0, 0.02, waiting=True) == 0  # 2 tokens: not yet
    assert gate.admit("acme", 500, 1.0, 0.05, waiting=True) == 0
    assert gate.admit("acme", 500, 1.0, 0.1, waiting=True) == 10  # a chunk: 0.1 s of it
    assert gate.admit("acme", 3, 1.0, 0.13, waiting=True) == 3  # wants less than a chunk
    assert gate.admit("acme", 500, 1.0, 0.135) == 0  # not waiting: what the bucket holds


def test_a_bucket_is_full_again_only_once_the_tenant_took_less_than_its_rate() -> None:
    """What lets a held-back tenant's partitions all go on again: its whole burst in
    the bucket (no quota: always)."""
    gate = TenantGate(Quota(rate=100, burst=100))
    assert gate.full("acme", 1.0, 0.0)  # nothing taken yet
    assert gate.admit("acme", 500, 1.0, 0.0) == 100
    assert not gate.full("acme", 1.0, 0.5)  # half of it back
    assert gate.admit("acme", 500, 1.0, 0.5, waiting=True) == 50
    assert not gate.full("acme", 1.0, 1.4)  # still taking its rate
    assert gate.full("acme", 1.0, 1.5)  # took nothing for a second: full again
    assert gate.full("globex", 1.0, 0.0)
    assert TenantGate().full("acme", 1.0, 0.0)  # no quota


def test_per_tenant_quotas_override_the_default() -> None:
    gate = TenantGate(Quota(rate=10))
    gate.configure(Quota(rate=10), {"globex": Quota()})
    assert gate.admit("globex", 1000, 1.0, 0.0) == 1000
    assert gate.admit("acme", 1000, 1.0, 0.0) == 10  # burst: one second's worth


def test_a_member_holding_a_third_admits_a_third() -> None:
    gate = TenantGate(Quota(rate=300, burst=300))
    assert gate.admit("acme", 1000, 1 / 3, 0.0) == 100
    assert gate.admit("acme", 1000, 1 / 3, 1.0) == 100


@given(
    rate=st.floats(1, 1000),
    burst=st.integers(0, 1000),
    steps=st.lists(st.tuples(st.floats(0, 2), st.integers(0, 2000), st.booleans()), max_size=50),
)
def test_never_more_than_burst_plus_rate_times_elapsed(
    rate: float, burst: int, steps: list[tuple[float, int, bool]]
) -> None:
    gate = TenantGate(Quota(rate=rate, burst=burst))
    now, admitted = 0.0, 0
    for elapsed, wanted, waiting in steps:
        now += elapsed
        got = gate.admit("acme", wanted, 1.0, now, waiting=waiting)
        assert 0 <= got <= wanted
        admitted += got
    assert admitted <= (burst or rate) + rate * now + 1e-6
