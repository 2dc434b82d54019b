"""The embedded stack's own failure modes: a broken data directory, a taken port, a
stale pid file, a service that dies under a running `alma up`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alma_core import errors
from alma_core.cli.embedded import PG_USER, EmbeddedStack, Postgres, Redis


async def test_broken_data_directory_says_how_to_reset(tmp_path: Path) -> None:
    (tmp_path / "postgres").mkdir()
    (tmp_path / "postgres" / "stray.txt").write_text("not a database")
    stack = EmbeddedStack(tmp_path, kafka_bootstrap="127.0.0.1:9", redis_url="redis://x:1/0")
    with pytest.raises(errors.StackError, match="holds no PostgreSQL data") as info:
        await stack.start()
    assert "move it away or remove it" in info.value.message
    assert (tmp_path / "postgres" / "stray.txt").exists(), "nothing is deleted unasked"


async def test_a_taken_port_is_avoided_when_none_was_asked_for(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        with pytest.raises(errors.StackError, match="did not start"):
            await redis.start(port=taken)  # asked for: a clear error
        await redis.start()  # not asked for: a free port is found
        try:
            assert redis.port != taken
            assert redis.running
        finally:
            await redis.stop()


def test_a_stale_pid_file_is_removed_and_a_running_postgres_is_not_started_beside(
    tmp_path: Path,
) -> None:
    pg = Postgres(tmp_path / "data", tmp_path / "run")
    pg.data_dir.mkdir(parents=True)
    pid_file = pg.data_dir / "postmaster.pid"
    heard: list[str] = []
    pg.notify = heard.append
    # a pid reused by another program, then one that looks like a running PostgreSQL
    with subprocess.Popen(["sleep", "60"]) as other:
        pid_file.write_text(f"{other.pid}\n{pg.data_dir}\n")
        pg.clear_stale_pid_file()
        other.kill()
    assert not pid_file.exists()
    assert f"removed the stale {pid_file} (pid {other.pid} is gone" in heard[0]
    with subprocess.Popen(["bash", "-c", "exec -a postgres sleep 60"]) as running:
        try:
            pid_file.write_text(f"{running.pid}\n")
            time.sleep(0.2)  # exec done
            with pytest.raises(
                errors.StackError, match=f"another PostgreSQL \\(pid {running.pid}\\)"
            ):
                pg.clear_stale_pid_file()
            assert pid_file.exists()
        finally:
            running.kill()


async def test_alma_up_stops_loudly_when_its_postgres_dies_and_starts_again(
    tmp_path: Path,
) -> None:
    """The embedded PostgreSQL SIGKILLed under a running `alma up`: it says which service
    died, how and where its log is, stops the rest and exits 1; the next `alma up`
    removes the stale pid file and starts. Run as root, it said first which user it
    adds and which directories it opens."""
    home = tmp_path / "closed"
    home.mkdir(mode=0o700)
    home.chmod(0o700)  # whatever the umask
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ALMA_")}
    env = {**clean, "ALMA_METRICS_PORT": "0", "ALMA_PARTITIONS": "2", "COLUMNS": "200"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "alma_core.cli",
        "up",
        env=env,
        cwd=home,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    endpoints = home / ".alma" / "endpoints.json"
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.returncode is None:
            if endpoints.exists() and "metrics_url" in endpoints.read_text():
                break
            await asyncio.sleep(0.2)
        assert proc.returncode is None, "alma up exited before it was up"
        assert stat.S_IMODE(endpoints.stat().st_mode) == 0o600
        postmaster = int((home / ".alma" / "postgres" / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGKILL)
        raw_out, raw_err = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out, err = raw_out.decode(), raw_err.decode()
    assert proc.returncode == 1, err[-3000:]
    assert "the embedded PostgreSQL stopped while `alma up` was running (killed by SIGKILL" in err
    assert str(home / ".alma" / "run" / "pg" / "postgres.log") in err
    assert "What to do: read the log above, then start `alma up` again" in err
    assert "stopped" in out
    assert not endpoints.exists()
    if os.geteuid() == 0:
        assert f"runs as the system user {PG_USER}" in err
        assert "lets it traverse /" in err
        assert f"{home} (chmod o+x: nothing in them becomes readable)" in err
        assert home.stat().st_mode & stat.S_IXOTH
    else:
        assert "running as root" not in err
        assert not home.stat().st_mode & stat.S_IXOTH

    again = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "alma_core.cli", "up", "--check"],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "removed the stale" in again.stderr
    assert f"(pid {postmaster} is gone" in again.stderr
    assert "ALMA Stream is up" in again.stdout
