"""What the fairness benchmark sets beside B's tail: the checkpointer's loop lateness
and the machine's busy and steal shares, and the verdict that reads them."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.stalls import MachineMeter, loop_lag
from bench.tenants import verdict


@pytest.mark.unit
async def test_a_loop_held_by_blocking_work_is_seen_late_by_as_long() -> None:
    async with loop_lag() as lag:
        await asyncio.sleep(0.05)  # a few on-time wake-ups first
        held = time.monotonic()
        time.sleep(0.08)  # noqa: ASYNC251 - the stall measured
        await asyncio.sleep(0.05)
    late = lag.since(held)
    assert max(late) >= 70  # woke at least the stall late, less the 10 ms it asked for
    assert len(lag.since(0)) > len(late) >= 2


@pytest.mark.unit
def test_the_machine_share_is_of_all_cores_between_start_and_stop() -> None:
    meter = MachineMeter()
    with pytest.raises(RuntimeError, match="before start"):
        meter.stop()
    meter.start()
    spin = time.monotonic() + 0.2
    while time.monotonic() < spin:  # busy on one core at least
        pass
    share = meter.stop()
    assert 0 < share.busy <= 1
    assert 0 <= share.steal <= share.busy


@pytest.mark.unit
def test_a_missed_target_is_attributed_to_the_machine_the_loop_or_what_is_outside_it() -> None:
    quiet = [
        {"busy": 0.5, "steal": 0.0, "loop_lags_ms": [1.0, 40.2]},
        {"busy": 0.6, "steal": 0.01, "loop_lags_ms": [2.0, 3.0]},
    ]
    assert verdict(1.2, quiet, 10, 1.0) == "met"
    assert verdict(1.8, quiet, 50, 1.1) == (
        "not met, with the machine 60% busy at the most; in the checkpointer's own loop, "
        "which stood up to 40 ms"
    )
    assert verdict(1.8, quiet, 90, 1.9) == (
        "not met, with the machine 60% busy at the most; outside the checkpointer's loop, "
        "which stood 40 ms at the longest where B's p99 rose 90 ms: in the broker's answers "
        "or the producers' (A's flood read by nobody: 1.90× alone)"
    )
    saturated = [{"busy": 0.97, "steal": 0.0, "loop_lags_ms": []}]
    assert "on a machine 97% busy" in verdict(1.8, saturated, 50, 1.0)
    stolen = [{"busy": 0.5, "steal": 0.08, "loop_lags_ms": []}]
    assert "quiet machine" in verdict(1.8, stolen, 50, 1.0)
