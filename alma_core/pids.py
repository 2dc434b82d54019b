"""Whether a process still runs, by its pid: for the files that name one (``alma up``'s
endpoints file, the embedded services' pid files)."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs: not gone, and not a zombie nobody reaped (read from
    /proc where there is one)."""
    stat_file = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            return stat_file.read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
