"""``alma up``'s watch over its embedded services while the stack runs.

* **PostgreSQL or Redis dies**: restarted in place (the same port, the same data:
  PostgreSQL recovers from its WAL, a stale pid file is removed) after a growing delay;
  the workers pause and retry meanwhile and go on where they were. Each restart is
  logged with its cause and counted; more than :attr:`RestartPolicy.limit` within
  :attr:`RestartPolicy.window_s` ends the stack with a message saying what to do.
* **Apache Kafka dies**: restarted in place like PostgreSQL (its log is on disk: every
  record it acknowledged is still there, and the consumers go on from their offsets).
* **Tansu dies**: it kept its log in memory, so what was published and not yet
  applied is gone. The stack stops, saying per partition how far the log went and how
  far ALMA had applied it (a fresh broker on the same port would race the clients'
  reconnections, which auto-create missing topics with the wrong partition count).
* **Memory**: each service's resident memory and the broker's log length are sampled
  (:class:`Watch`); the broker keeps every record and reads slow down as a partition
  fills, so a warning says so, with the remedy, before it hurts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alma_core import errors
from alma_core.cli.embedded import EmbeddedStack, in_memory
from alma_core.cli.embedded_process import Notify, Service, describe_status, tail

log = logging.getLogger("alma.embedded")


@dataclass(frozen=True)
class RestartPolicy:
    """When a service that died is started again: after ``initial_s``, doubling up to
    ``max_s``; never more than ``limit`` times within ``window_s``."""

    limit: int = 5
    window_s: float = 600.0
    initial_s: float = 0.5
    max_s: float = 30.0

    def delay(self, earlier: Sequence[float], now: float) -> float | None:
        """Seconds to wait before the next restart, given the times of the earlier ones
        (None: give up)."""
        recent = sum(1 for t in earlier if now - t < self.window_s)
        if recent >= self.limit:
            return None
        return float(min(self.max_s, self.initial_s * 2**recent))


class ServiceLost(errors.StackError):
    """An embedded service could not be kept running."""


class Supervisor:
    """Restarts the stack's PostgreSQL, Redis and Apache Kafka when they die (see the module
    docstring); ``unapplied()`` describes, when the broker dies, what it took with it."""

    def __init__(
        self,
        stack: EmbeddedStack,
        *,
        notify: Notify,
        policy: RestartPolicy | None = None,
        on_restart: Callable[[str], None] = lambda _name: None,
        unapplied: Callable[[], str] = lambda: "",
    ) -> None:
        self.stack = stack
        self.notify = notify
        self.policy = policy or RestartPolicy()
        self.on_restart = on_restart
        self.unapplied = unapplied
        self.restarts: dict[str, list[float]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set; raises :class:`ServiceLost` when a service cannot be
        kept running."""
        while not stop.is_set():
            died = await _first_of(self.stack.first_exit(), stop)
            if died is None:
                return
            service, status = died
            if service is self.stack.broker and in_memory(self.stack):
                raise ServiceLost(self._broker_lost(service, status))
            await self._revive(service, describe_status(status), stop)

    async def _revive(self, service: Service, cause: str, stop: asyncio.Event) -> None:
        earlier = self.restarts.setdefault(service.name, [])
        port = service.port
        while True:
            now = time.monotonic()
            delay = self.policy.delay(earlier, now)
            if delay is None:
                raise ServiceLost(
                    f"the embedded {service.title} stopped again ({cause}) after "
                    f"{self.policy.limit} restarts within {self.policy.window_s / 60:.0f} "
                    f"minutes; its log: {service.log_path}\n{tail(service.log_path)}\n"
                    "What to do: read the log above (a full disk, memory, a damaged data "
                    "directory), mend it and start `alma up` again"
                )
            earlier.append(now)
            self.notify(
                f"the embedded {service.title} stopped ({cause}; its log: "
                f"{service.log_path}); restarting it on port {port} in {delay:.1f} s "
                f"(restart {len(earlier)}; the workers pause and go on once it is back)"
            )
            log.warning(
                "embedded service restarting",
                extra={
                    "action": "embedded_restart",
                    "service": service.name,
                    "cause": cause,
                    "delay_s": round(delay, 1),
                    "restart": len(earlier),
                },
            )
            if await _stopped(stop, delay):
                return
            try:
                await service.start(port=port)
            except errors.StackError as exc:
                cause = f"it did not start again: {exc.message.splitlines()[0]}"
                continue
            self.stack.record_children()
            self.on_restart(service.name)
            self.notify(f"the embedded {service.title} is back on port {port}")
            return

    def _broker_lost(self, broker: Service, status: int) -> str:
        lost = self.unapplied()
        return (
            f"the embedded {broker.title} stopped while `alma up` was running "
            f"({describe_status(status)}; its log: {broker.log_path}). It kept its records in "
            "memory: what was published and not yet applied is gone"
            + (f":\n{lost}" if lost else " (nothing was waiting to be applied)")
            + f"\n{tail(broker.log_path)}\nWhat to do: read the log above, then start `alma "
            "up` again (a new, empty broker) and publish again what the lines above say was "
            "lost; for a stack that keeps its log, use Apache Kafka (`alma up --broker "
            "kafka`, after `make kafka`)"
        )


async def _first_of(
    waiting: Coroutine[Any, Any, tuple[Service, int]], stop: asyncio.Event
) -> tuple[Service, int] | None:
    """What ``waiting`` returns, or None once ``stop`` is set first."""
    task = asyncio.ensure_future(waiting)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if task.done() and not task.cancelled() else None


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


def resident_bytes(groups: set[int]) -> dict[int, int] | None:
    """What each process group of ``groups`` (a service and what it started:
    PostgreSQL's backends) holds in memory: the sum of each process's proportional set
    size (shared memory counted once overall), its resident set where that is not
    readable. One pass over /proc for them all. None: no /proc."""
    proc = Path("/proc")
    if not proc.exists():
        return None
    totals = dict.fromkeys(groups, 0)
    for entry in proc.iterdir():
        if not entry.name.isdecimal():
            continue
        try:
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
            group = int(stat[2])
            if group in totals:
                totals[group] += _pss(entry)
        except (OSError, ValueError, IndexError):
            continue
    return totals


def _pss(entry: Path) -> int:
    with contextlib.suppress(OSError):
        for line in (entry / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    for line in (entry / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class Limits:
    """When the embedded broker starts to hurt. It keeps every record in memory, and
    each read of a partition with new records lists every batch the partition ever
    stored, so the latency from publish to checkpoint grows with the longest partition:
    the defaults are where the soak's p50 began to climb (docs/benchmarks.md)."""

    broker_bytes: int = 256 << 20
    partition_records: int = 3_000


class Watch:
    """Samples, every ``every_s``, each embedded service's memory and the length of each
    partition's log as this process's consumers last saw it; warns (once, and again at
    each doubling) when the broker nears :class:`Limits`, saying what to do."""

    def __init__(
        self,
        stack: EmbeddedStack,
        *,
        notify: Notify,
        memory: Callable[[str, int], None],
        logs: Callable[[], dict[tuple[str, int], int]],
        log_length: Callable[[str, int, int], None],
        limits: Limits | None = None,
        every_s: float = 10.0,
    ) -> None:
        self.stack = stack
        self.notify = notify
        self.memory = memory
        self.logs = logs
        self.log_length = log_length
        self.limits = limits or Limits()
        self.every_s = every_s
        self._warned_at = 0.0  # the last warning's level, in multiples of the limits

    async def run(self, stop: asyncio.Event) -> None:
        while not await _stopped(stop, self.every_s):
            self.sample()

    def sample(self) -> None:
        broker_bytes = 0
        running = {service.pid: service for service in self.stack.services if service.pid}
        for pid, held in (resident_bytes(set(running)) or {}).items():
            service = running[pid]
            self.memory(service.name, held)
            if service is self.stack.broker:
                broker_bytes = held
        lengths = self.logs()
        for (topic, partition), records in lengths.items():
            self.log_length(topic, partition, records)
        if not in_memory(self.stack):  # Apache Kafka: its log on disk, its heap bounded
            return
        longest = max(lengths.items(), key=lambda item: item[1], default=(("", 0), 0))
        level = max(
            broker_bytes / self.limits.broker_bytes, longest[1] / self.limits.partition_records
        )
        if level >= 1 and level >= 2 * self._warned_at:
            self._warned_at = level
            self._warn(broker_bytes, longest)

    def _warn(self, broker_bytes: int, longest: tuple[tuple[str, int], int]) -> None:
        (topic, partition), records = longest
        message = (
            f"the embedded Kafka broker keeps every record in memory and its reads slow "
            f"down as a partition fills: it holds {broker_bytes / 2**20:,.0f} MB, and "
            f"partition {partition} of {topic} {records:,} records (warned at "
            f"{self.limits.broker_bytes / 2**20:,.0f} MB or {self.limits.partition_records:,} "
            "records a partition; the latency from publish to checkpoint grows with the "
            "longest partition from here on). What to do: for a stack that runs for "
            "hours, use Apache Kafka (`alma up --broker kafka`, after `make kafka`, or "
            "ALMA_KAFKA_BOOTSTRAP pointing at one); or, once nothing is waiting "
            "(alma_consumer_lag 0 everywhere), restart "
            "`alma up`: its broker starts empty, and nothing applied is lost"
        )
        self.notify(message)
        log.warning(
            message,
            extra={
                "action": "embedded_broker_growing",
                "broker_bytes": broker_bytes,
                "topic": topic,
                "partition": partition,
                "records": records,
            },
        )
