"""Shared test settings: hypothesis profile for a small, shared 2-core machine, a
temporary directory of each run's own, and a check that it has room for a run."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "alma",
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# `make check`'s (pytest --hypothesis-profile=quick): the same properties, fewer examples
settings.register_profile("quick", parent=settings.get_profile("alma"), max_examples=20)
settings.load_profile("alma")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/unit is marked ``unit`` (no service, seconds): `make check`
    runs those and the ``smoke`` tests; every ``chaos`` test is ``slow`` too."""
    for item in items:
        if "tests/unit/" in item.nodeid or item.nodeid.startswith("unit/"):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("chaos"):  # killing processes takes its time
            item.add_marker(pytest.mark.slow)


# What a whole run writes under the temporary directory (embedded PostgreSQL, broker
# and Redis data, benchmarks' stacks): ~3 GB measured, of which the last three runs'
# directories are kept. Below this, refuse at the start rather than fail at 90 %.
MIN_FREE_BYTES = 2 * 1024**3


# Each run's own base temporary directory, locked while the run lasts. pytest's shared
# one (pytest-of-USER) is made 0700 again by every run that starts: a second run (unit
# tests beside the suite) would then cut this run's embedded PostgreSQL, which runs as
# another user, off its data directory (PANIC: Permission denied).
_BASE_PREFIX = "alma-pytest-"
_RUNS_KEPT = 3  # the newest runs' directories stay for a look after a failure
_held: list[int] = []


def _unused(path: Path) -> bool:
    """Whether no running session holds ``path``'s lock."""
    try:
        fd = os.open(path / ".lock", os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def pytest_configure(config: pytest.Config) -> None:
    if config.option.basetemp or hasattr(config, "workerinput"):
        return  # given on the command line (or a worker's, from its controller)
    root = Path(tempfile.gettempdir())
    old = sorted(root.glob(f"{_BASE_PREFIX}*"), key=lambda p: p.stat().st_mtime)
    for path in old[: max(0, len(old) - (_RUNS_KEPT - 1))]:
        if _unused(path):
            shutil.rmtree(path, ignore_errors=True)
    base = Path(tempfile.mkdtemp(prefix=_BASE_PREFIX))
    fd = os.open(base / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # released when the run's process ends
    _held.append(fd)
    # pytest empties an explicit basetemp: a directory inside the one kept locked
    config.option.basetemp = str(base / "run")


def pytest_unconfigure(config: pytest.Config) -> None:
    while _held:
        with contextlib.suppress(OSError):
            os.close(_held.pop())


_stacks_dirs: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    # the suite's own registry of running `alma up` stacks (tests/services.py), removed
    # at the end (every stack the suite started has stopped by then)
    _stacks_dirs.append(tempfile.mkdtemp(prefix="alma-stacks-"))
    os.environ["ALMA_STACKS_DIR"] = _stacks_dirs[-1]
    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free
    if free < MIN_FREE_BYTES:
        pytest.exit(
            f"only {free / 1024**3:.1f} GiB free under {tmp}; the suite needs about "
            f"{MIN_FREE_BYTES / 1024**3:.0f} GiB there: free space (old alma-bench-* and "
            "alma-pytest-* directories there are safe to remove) or point TMPDIR elsewhere",
            returncode=3,
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _stacks_dirs:
        shutil.rmtree(_stacks_dirs.pop(), ignore_errors=True)
