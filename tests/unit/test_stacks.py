"""Finding the running `alma up` from any directory: ALMA_DATA_DIR alone when set,
else `.alma` here and above, else the per-user registry; stacks that are gone are never
found, and two running stacks are a question for the user, not a guess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alma_core import errors, stacks


def gone_pid() -> int:
    """A pid that names no process (exited and reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_stack(data_dir: Path, pid: int, port: int) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / stacks.ENDPOINTS_FILE).write_text(
        json.dumps({"kafka_bootstrap": f"127.0.0.1:{port}", "pid": pid})
    )


def search_from(cwd: Path, registry: Path, data_dir: Path | None = None) -> stacks.Search:
    if data_dir is None:
        return stacks.Search(stacks.DEFAULT_DATA_DIR, False, registry, cwd)
    return stacks.Search(data_dir, True, registry, cwd)


def test_a_stack_in_a_directory_above_is_found(tmp_path: Path) -> None:
    project = tmp_path / "project"
    write_stack(project / ".alma", os.getpid(), 9001)
    deep = project / "src" / "pkg"
    deep.mkdir(parents=True)
    found = stacks.find(search_from(deep, tmp_path / "registry"))
    assert found is not None
    assert found.data_dir == (project / ".alma").resolve()
    assert found.endpoints["kafka_bootstrap"] == "127.0.0.1:9001"


def test_the_registry_finds_a_stack_from_an_unrelated_directory(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert stacks.find(search_from(elsewhere, registry)) is None
    write_stack(tmp_path / "stack" / ".alma", os.getpid(), 9002)
    stacks.register(registry, tmp_path / "stack" / ".alma")
    found = stacks.find(search_from(elsewhere, registry))
    assert found is not None
    assert found.endpoints["kafka_bootstrap"] == "127.0.0.1:9002"
    stacks.unregister(registry)
    assert stacks.find(search_from(elsewhere, registry)) is None


def test_an_explicit_data_dir_is_the_only_place_looked(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    write_stack(tmp_path / "stack", os.getpid(), 9003)
    stacks.register(registry, tmp_path / "stack")
    search = search_from(tmp_path, registry, data_dir=tmp_path / "empty")
    assert stacks.find(search) is None
    assert str(tmp_path / "empty" / stacks.ENDPOINTS_FILE) in search.described()


def test_a_stack_that_is_gone_is_not_found_and_its_entry_is_removed(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    pid = gone_pid()
    write_stack(tmp_path / "stack", pid, 9004)
    stacks.register(registry, tmp_path / "stack", pid)
    assert (registry / f"{pid}.json").exists()
    assert stacks.find(search_from(tmp_path / "stack", registry)) is None
    assert not (registry / f"{pid}.json").exists()


def test_two_running_stacks_are_named_not_guessed(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    with subprocess.Popen(["sleep", "30"]) as other:
        try:
            write_stack(tmp_path / "a", os.getpid(), 9005)
            write_stack(tmp_path / "b", other.pid, 9006)
            stacks.register(registry, tmp_path / "a")
            stacks.register(registry, tmp_path / "b", other.pid)
            with pytest.raises(errors.ConfigError, match="2 `alma up` are running") as info:
                stacks.find(search_from(tmp_path, registry))
            assert str(tmp_path / "a") in info.value.message
            assert str(tmp_path / "b") in info.value.message
            assert "ALMA_DATA_DIR" in info.value.message
        finally:
            other.kill()


def test_the_search_says_where_it_looked(tmp_path: Path) -> None:
    described = search_from(tmp_path, tmp_path / "registry").described()
    assert str(tmp_path) in described
    assert "every directory above it" in described
    assert str(tmp_path / "registry") in described
