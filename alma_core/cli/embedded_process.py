"""One child process of the embedded stack: started on a free loopback port with its
own log file, polled until ready (never slept), stopped gracefully, and watched.

A port taken between choosing and binding is avoided: the process exits, and it is
started again on another port. ``exit_status`` says how a process that went away
ended, so ``alma up`` can restart it or stop loudly. On Linux a child never outlives
the process that started it, however that one ends (SIGKILL included): it is started
with a parent-death signal (``prctl(PR_SET_PDEATHSIG)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alma_core import errors

log = logging.getLogger("alma.embedded")
START_ATTEMPTS = 4
READY_TIMEOUT_S = 30.0

Notify = Callable[[str], None]  # how a service tells a person what it does to the host


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (mode 0600): the file is
    created that way (a temporary file beside it, renamed over it), so a secret is
    never in a file others can read, not even for a moment, and one written before
    with a wider mode is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def log_notice(message: str) -> None:
    """The default :data:`Notify`: a warning in the log (``alma up`` prints instead)."""
    log.warning(message, extra={"action": "embedded_notice"})


_PR_SET_PDEATHSIG = 1


def parent_death_hook() -> Callable[[], None] | None:
    """What a child runs between fork and exec so that the kernel SIGKILLs it when the
    thread that started it ends (Linux; None elsewhere). Runs after Popen's own user
    change, which would clear it; a parent already gone by then is noticed too."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bindable(port: int, *, reuse: bool = False) -> bool:
    """Whether a listener could bind ``port`` on loopback now; with ``reuse`` (as the
    services set SO_REUSEADDR), a port whose last connections are in TIME_WAIT counts
    as free, one with a listener still does not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_pair(offset: int, highest: int, attempts: int = 200) -> int:
    """A free loopback port no higher than ``highest`` whose ``port + offset`` is free
    too (a Redis Cluster node listens on both, and refuses a port above 55535). Drawn
    below Linux's ephemeral range (32768 up), where the kernel hands out no port of
    its own, rather than from the kernel, whose picks may all lie above ``highest``."""
    low = min(20000, highest)
    for _ in range(attempts):
        port = random.randint(low, min(highest, 32767))
        if bindable(port) and bindable(port + offset):
            return port
    raise errors.StackError(
        f"no free pair of loopback ports {offset} apart found below {highest} in "
        f"{attempts} tries.\nWhat to do: free some ports between {low} and "
        f"{highest + offset} (see `ss -tln`) and run again"
    )


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def describe_status(returncode: int) -> str:
    """``returncode`` of a child in words: ``exit status 1``, ``killed by SIGKILL``."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class Service:
    """One child process with a log file, started on a free port."""

    name = "service"
    title = "service"  # what a person calls it: "the embedded {title}"
    # the signal that asks it to stop (PostgreSQL: fast shutdown; Redis: shut down)
    stop_signal: int = signal.SIGINT

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = run_dir / f"{self.name}.log"
        self.notify: Notify = log_notice

    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    # the module of the 'embedded' extra this service runs from, its distribution, and
    # the setting that names a service of one's own instead (for the message that
    # says what to install)
    module: str | None = None
    wheel = ""
    setting = ""

    def lacks(self) -> str | None:
        """The distribution this service needs and this environment has not; None when
        it can start."""
        if self.module is None or importlib.util.find_spec(self.module) is not None:
            return None
        return self.wheel

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    def _free_port(self) -> int:
        return free_port()

    async def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    async def start(self, port: int | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(START_ATTEMPTS):
            self.port = port or self._free_port()
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; watched by poll()
                    self._command(self.port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=parent_death_hook(),  # prctl and kill: async-signal-safe
                    **self._popen_kwargs(),
                )
            if await self._wait_ready():
                return
            last = tail(self.log_path)
            await self.stop()
            if port:
                break
        raise errors.StackError(
            f"{self.name} did not start (log {self.log_path}):\n{last}\n"
            f"What to do: read the log above; {self._advice()}"
        )

    def _advice(self) -> str:
        return "check that nothing else is broken on this machine and run again"

    async def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            with contextlib.suppress(Exception):
                if await self._ready():
                    return True
            await asyncio.sleep(0.05)
        return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    async def stop(self, sig: int | None = None, grace_s: float = 15.0) -> None:
        """Stop gracefully (``stop_signal`` unless ``sig``), then kill if it does not exit
        in time (logged, with the end of its log: a kill skips its own shutdown)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(self.stop_signal if sig is None else sig)
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a child
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            log.warning(
                f"the embedded {self.title} did not stop within {grace_s:g} s: killed; the end "
                f"of its log ({self.log_path}):\n{tail(self.log_path)}",
                extra={"action": "embedded_stop_killed", "service": self.name},
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.to_thread(proc.wait)

    def kill(self) -> None:
        """SIGKILL the service and every process it started (chaos tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    @property
    def exit_status(self) -> int | None:
        """None while running (or never started); else how the process ended. Polling
        reaps it, so a dead child never lingers as a zombie holding its pid."""
        return None if self.proc is None else self.proc.poll()

    def kill_leftovers(self) -> None:
        """After the service's process ended: SIGKILL what it started and left behind
        (PostgreSQL's backends outlive a killed postmaster for a moment and hold its
        shared memory, which would stop the next start)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
