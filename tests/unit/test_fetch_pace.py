"""The embedded broker's fetch pace: a pure decision of the consumers' loop."""

from __future__ import annotations

from alma_core.consumers.retry import FetchPacer


def test_the_fetch_pace_is_short_under_load_and_long_once_idle() -> None:
    """The embedded broker's consumers fetch with a short wait while records come and a
    long one once none came for a while; any record brings the short wait back."""
    pacer = FetchPacer(busy_ms=20, idle_ms=500, idle_after_s=2.0)
    assert pacer.wait_ms(100.0, got_records=True) == 20
    assert pacer.wait_ms(101.9, got_records=False) == 20  # not quiet long enough
    assert pacer.wait_ms(102.0, got_records=False) == 500
    assert pacer.wait_ms(130.0, got_records=False) == 500
    assert pacer.wait_ms(130.1, got_records=True) == 20
    # off: no idle wait, or one not above the busy wait
    assert FetchPacer(busy_ms=20).wait_ms(1e6, got_records=False) == 20
    assert FetchPacer(busy_ms=100, idle_ms=50).wait_ms(1e6, got_records=False) == 100
