"""CPU time by process over a stretch of a benchmark: where a checkpoint's CPU goes.

A :class:`CpuMeter` reads, at :meth:`CpuMeter.start` and again at :meth:`CpuMeter.stop`,
the CPU time of this process, of its other descendants (worker processes), and of each
service of the stack: the process listening on the broker's, PostgreSQL's and Redis's
port, with its descendants (whoever started them: the embedded stack, or a test run's
services). PostgreSQL's backends come and go with their connections; a backend that
ended in between is counted through its postmaster's reaped-children times. The
machine's busy share over the same stretch says whether the 2 cores were the limit
(near 100 %) or something else was (waits, round trips). A service on another machine
is not measured (:attr:`CpuShare.unseen`). Times come in clock ticks (10 ms on Linux):
a part that did little over a short stretch reads 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil

from alma_core.consumers.worker import Services
from bench.stalls import MachineMeter

# Process groups, in the order the tables show them.
GROUPS = ("benchmark process", "worker processes", "broker", "PostgreSQL", "Redis")


def service_ports(services: Services) -> dict[str, list[int]]:
    """The loopback ports the stack's services listen on, by group."""
    kafka = [int(h.rpartition(":")[2]) for h in services.kafka_bootstrap.split(",") if ":" in h]
    pg, redis = urlsplit(services.postgres_dsn).port, urlsplit(services.redis_url).port
    return {"broker": kafka, "PostgreSQL": [pg or 5432], "Redis": [redis or 6379]}


@dataclass(frozen=True)
class CpuShare:
    """CPU seconds by group over a stretch, and the machine's busy share in it."""

    seconds: dict[str, float]
    busy: float  # share of all cores busy (any process), 0–1
    unseen: list[str] = field(default_factory=list)  # services not found on this machine

    def per(self, count: int) -> dict[str, float]:
        """Milliseconds of CPU per item (checkpoint) by group (:data:`GROUPS`, then any
        other group the meter was given), and in total."""
        groups = (*GROUPS, *sorted(set(self.seconds) - set(GROUPS)))
        out = {g: self.seconds.get(g, 0.0) * 1000 / max(1, count) for g in groups}
        out["total"] = sum(out.values())
        return out


def _times(proc: psutil.Process, reaped: bool) -> float:
    t = proc.cpu_times()
    own = float(t.user + t.system)
    return own + (float(t.children_user + t.children_system) if reaped else 0.0)


class CpuMeter:
    """CPU time of this process, its descendants and the stack's services between
    start() and stop()."""

    def __init__(self, ports: dict[str, list[int]]) -> None:
        self.ports = ports
        self.me = psutil.Process()
        self._before: dict[int, tuple[str, float]] = {}
        self._machine = MachineMeter()
        self._listeners_now: dict[int, str] = {}
        self.last: CpuShare | None = None  # what the latest stop() measured

    def _listeners(self) -> dict[int, str]:
        wanted = {port: group for group, ports in self.ports.items() for port in ports}
        found: dict[int, str] = {}
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.pid and conn.laddr.port in wanted:
                found[conn.pid] = wanted[conn.laddr.port]
        return found

    def _read(self, listeners: dict[int, str]) -> dict[int, tuple[str, float]]:
        out: dict[int, tuple[str, float]] = {}
        for pid, group in listeners.items():
            try:
                root = psutil.Process(pid)
                # a postmaster's reaped children are its ended backends
                out[pid] = (group, _times(root, reaped=True))
                for child in root.children(recursive=True):
                    out[child.pid] = (group, _times(child, reaped=False))
            except psutil.Error:  # ended while read
                continue
        out[self.me.pid] = ("benchmark process", _times(self.me, reaped=False))
        for child in self.me.children(recursive=True):
            if child.pid not in out:
                try:
                    out[child.pid] = ("worker processes", _times(child, reaped=False))
                except psutil.Error:
                    continue
        return out

    def start(self) -> None:
        self._listeners_now = self._listeners()
        self._machine.start()
        self._before = self._read(self._listeners_now)

    def stop(self) -> CpuShare:
        after, machine = self._read(self._listeners_now), self._machine.stop()
        seconds: dict[str, float] = {}
        for pid, (group, t) in after.items():
            seconds[group] = seconds.get(group, 0.0) + t - self._before.get(pid, (group, 0.0))[1]
        unseen = sorted(set(self.ports) - set(self._listeners_now.values()))
        self.last = CpuShare(seconds, machine.busy, unseen)
        return self.last
