"""What held a process back over a stretch of a benchmark, measured beside a latency so
that a slow tail can be attributed: this process's event loop (how late it woke when it
asked to), and the machine (how busy its cores were, and how much time the hypervisor
gave to other guests: steal).

A latency's tail that grows with the loop's lag while the machine is near 100 % busy
or stolen from is the machine's stall, not the code's choice; one that grows with the
machine idle is the code's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import psutil

INTERVAL_S = 0.01  # how often the loop is asked to wake: lateness below it goes unseen


@dataclass
class LoopLag:
    """How late this process's event loop woke, each :data:`INTERVAL_S`: (when it
    woke, ``time.monotonic()``; how late, ms)."""

    samples: list[tuple[float, float]] = field(default_factory=list)

    def since(self, start: float) -> list[float]:
        """The lags, in ms, of the wake-ups at or after ``start``."""
        return [lag for at, lag in self.samples if at >= start]

    async def _sample(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(INTERVAL_S)
            woke = time.monotonic()
            self.samples.append((woke, max(0.0, (woke - asked - INTERVAL_S) * 1000)))


@contextlib.asynccontextmanager
async def loop_lag() -> AsyncIterator[LoopLag]:
    """Samples the running loop's lag until the block ends."""
    lag = LoopLag()
    task = asyncio.create_task(lag._sample())
    try:
        yield lag
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(frozen=True)
class MachineShare:
    """The share of all cores' time that was busy (any process) and stolen, 0–1."""

    busy: float
    steal: float


class MachineMeter:
    """The machine's busy and steal shares between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self._before: tuple[float, float, float] | None = None

    @staticmethod
    def _read() -> tuple[float, float, float]:
        t = psutil.cpu_times()  # seconds summed over every core since boot
        idle = t.idle + getattr(t, "iowait", 0.0)
        return idle, getattr(t, "steal", 0.0), sum(t)

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> MachineShare:
        if self._before is None:
            raise RuntimeError("MachineMeter.stop() before start()")
        idle, steal, total = (b - a for a, b in zip(self._before, self._read(), strict=True))
        if total <= 0:
            return MachineShare(0.0, 0.0)
        return MachineShare(busy=1 - idle / total, steal=steal / total)
