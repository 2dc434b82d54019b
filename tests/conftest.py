"""Shared test settings: hypothesis profile for a small, shared 2-core machine, and a
check that the temporary directory has room for a run."""

from __future__ import annotations

import os
import shutil
import tempfile

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
# and Redis data, benchmarks' stacks): ~3 GB measured, of which pytest keeps the last
# three runs' directories. Below this, refuse at the start rather than fail at 90 %.
MIN_FREE_BYTES = 2 * 1024**3


def pytest_sessionstart(session: pytest.Session) -> None:
    # the suite's own registry of running `alma up` stacks (tests/services.py)
    os.environ["ALMA_STACKS_DIR"] = tempfile.mkdtemp(prefix="alma-stacks-")
    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free
    if free < MIN_FREE_BYTES:
        pytest.exit(
            f"only {free / 1024**3:.1f} GiB free under {tmp}; the suite needs about "
            f"{MIN_FREE_BYTES / 1024**3:.0f} GiB there: free space (old alma-bench-* and "
            "pytest-of-* directories there are safe to remove) or point TMPDIR elsewhere",
            returncode=3,
        )
