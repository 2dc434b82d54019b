"""Finding the ``alma up`` that is running, from any directory.

``alma up`` writes its endpoints (real DSNs, mode 0600) to ``endpoints.json`` in its
data directory and registers itself in a per-user registry: one small file per running
stack in ``ALMA_STACKS_DIR`` (``~/.local/state/alma/stacks``) naming its data directory.
An application (``load_running()``) or a command looks, in this order:

1. ``ALMA_DATA_DIR`` when it is set: that stack or none, nothing else;
2. ``.alma`` in the current directory, then in each directory above it;
3. the registry: the one stack running for this user; several are an error that names
   them (set ``ALMA_DATA_DIR`` to choose).

A stack whose process is gone (killed without its clean-up) is never found: its files
name a pid that no longer runs, and its registry entry is removed when seen.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alma_core import errors
from alma_core.pids import alive

ENDPOINTS_FILE = "endpoints.json"  # what `alma up` writes into its data directory
DEFAULT_DATA_DIR = Path(".alma")


@dataclass(frozen=True)
class Running:
    """An ``alma up`` that runs: its data directory and what it wrote there."""

    data_dir: Path
    endpoints: dict[str, Any]


@dataclass(frozen=True)
class Search:
    """Where to look: the data directory the settings name (``explicit`` when
    ``ALMA_DATA_DIR`` was set), the registry, and the directory to search up from."""

    data_dir: Path
    explicit: bool
    stacks_dir: Path
    cwd: Path | None = None

    def places(self) -> list[Path]:
        """The data directories to try before the registry, in order."""
        if self.explicit or self.data_dir != DEFAULT_DATA_DIR:
            return [self.data_dir]
        here = (self.cwd or Path.cwd()).resolve()
        return [folder / DEFAULT_DATA_DIR for folder in (here, *here.parents)]

    def described(self) -> str:
        """Where :func:`find` looked, for a message that says so."""
        if self.explicit or self.data_dir != DEFAULT_DATA_DIR:
            return f"looked in {self.data_dir.resolve() / ENDPOINTS_FILE} (ALMA_DATA_DIR)"
        here = (self.cwd or Path.cwd()).resolve()
        return (
            f"looked for {DEFAULT_DATA_DIR / ENDPOINTS_FILE} in {here} and every directory "
            f"above it, and in the registry of running stacks {self.stacks_dir}"
        )


def endpoints_in(data_dir: Path) -> dict[str, Any]:
    """The endpoints of the ``alma up`` running on ``data_dir``; nothing when there is
    none, or the one that wrote the file is gone (its ports closed, or taken by
    something else)."""
    path = data_dir / ENDPOINTS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    pid = data.get("pid")
    return {} if isinstance(pid, int) and not alive(pid) else data


def find(search: Search) -> Running | None:
    """The running ``alma up`` that :class:`Search` leads to, or None. Several running
    where only the registry could choose: :class:`errors.ConfigError` naming them."""
    for data_dir in search.places():
        found = endpoints_in(data_dir)
        if found:
            return Running(data_dir.resolve(), found)
    if search.explicit or search.data_dir != DEFAULT_DATA_DIR:
        return None
    registered = _registered(search.stacks_dir)
    if len(registered) > 1:
        names = ", ".join(f"{r.data_dir} (pid {r.endpoints.get('pid')})" for r in registered)
        raise errors.ConfigError(
            f"{len(registered)} `alma up` are running: {names}. What to do: set "
            "ALMA_DATA_DIR to the data directory of the one to use, or run from its directory"
        )
    return registered[0] if registered else None


def _registered(stacks_dir: Path) -> list[Running]:
    """The registered stacks that still run, oldest first; entries of stacks that are
    gone are removed."""
    found = []
    entries = sorted(stacks_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for entry in entries:
        try:
            data_dir = Path(json.loads(entry.read_text())["data_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            data_dir = None
        running = endpoints_in(data_dir) if data_dir else {}
        if running and entry.stem == str(running.get("pid")):
            found.append(Running(data_dir, running))  # type: ignore[arg-type]
        elif not (entry.stem.isdecimal() and alive(int(entry.stem))):
            with contextlib.suppress(OSError):
                entry.unlink()  # its stack is gone
    return found


def _entry(stacks_dir: Path, pid: int | None) -> Path:
    """A stack's file in the registry: one per running ``alma up``, named by its pid."""
    return stacks_dir / f"{os.getpid() if pid is None else pid}.json"


def register(stacks_dir: Path, data_dir: Path, pid: int | None = None) -> None:
    """Record the stack of process ``pid`` (default: this one) on ``data_dir`` in the
    registry; :func:`unregister` removes it when the stack stops."""
    stacks_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    entry = _entry(stacks_dir, pid)
    tmp = entry.with_suffix(".tmp")
    tmp.write_text(json.dumps({"data_dir": str(data_dir.resolve()), "pid": int(entry.stem)}))
    tmp.replace(entry)


def unregister(stacks_dir: Path, pid: int | None = None) -> None:
    with contextlib.suppress(OSError):
        _entry(stacks_dir, pid).unlink()
