"""The embedded stack's own failure modes: a broken data directory, a taken port, a
stale pid file; under a running `alma up`, a PostgreSQL or Redis that dies (restarted
in place), a broker that dies (the end, said plainly), and `alma up` itself killed
(no child outlives it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from alma_core import errors
from alma_core.cli.embedded import PG_USER, EmbeddedStack, Postgres, Redis
from alma_core.settings import load
from tests.integration.harness import (
    Publisher,
    WorkerProcess,
    assert_exactly_once,
    completed,
    count,
    wait_for,
)
from tests.services import without_alma_settings


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


async def test_postgres_starts_in_a_deep_data_directory(tmp_path: Path) -> None:
    """A Unix socket's path holds at most 107 bytes: the embedded PostgreSQL listens on
    TCP alone, so a data directory nested deep (a CI workspace, a temporary directory of
    a test) starts as any other."""
    deep = tmp_path / ("a-directory-with-a-long-name-" * 3) / "and-deeper-still"
    assert len(str(deep / "run" / "pg" / ".s.PGSQL.65535")) > 107
    pg = Postgres(deep / "postgres", deep / "run" / "pg", durable=False)
    await pg.start()
    try:
        assert pg.running
    finally:
        await pg.stop()


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


class AlmaUp:
    """`alma up` as a user runs it, in a directory of its own, its output in files."""

    def __init__(
        self, home: Path, *, python: Path | None = None, args: tuple[str, ...] = (), **env: str
    ) -> None:
        self.home = home
        self.args = args
        self.python = python or Path(sys.executable)  # the checkout's, or an installed wheel's
        clean = without_alma_settings()
        self.env = {
            **clean,
            "ALMA_METRICS_PORT": "0",
            "ALMA_PARTITIONS": "4",
            "COLUMNS": "200",
            **env,
        }
        self.out, self.err = home / "up.out", home / "up.err"
        self.endpoints_file = home / ".alma" / "endpoints.json"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> dict[str, Any]:
        with self.out.open("ab") as out, self.err.open("ab") as err:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                [self.python, "-m", "alma_core.cli", "up", *self.args],
                env=self.env,
                cwd=self.home,
                stdout=out,
                stderr=err,
            )

        async def up() -> bool:
            assert self.running, f"alma up exited:\n{self.stderr()[-3000:]}"
            text = self.endpoints_file.read_text() if self.endpoints_file.exists() else ""
            return "metrics_url" in text

        await wait_for(up, limit_s=150, what="alma up to be up")
        endpoints: dict[str, Any] = json.loads(self.endpoints_file.read_text())
        return endpoints

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def children(self) -> dict[str, int]:
        recorded = json.loads((self.home / ".alma" / "run" / "children.json").read_text())
        return {child["service"]: int(child["pid"]) for child in recorded}

    async def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, 60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(url: str, name: str, **labels: str) -> float:
    """The largest sample of ``name`` with these labels on a Prometheus text page (0 when
    there is none)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as page:
        text = page.read().decode()
    return max(
        (
            float(sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        ),
        default=0.0,
    )


def in_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a service and what it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


@pytest.mark.slow
async def test_alma_up_restarts_its_postgres_and_redis_mid_stream(tmp_path: Path) -> None:
    """Under a running `alma up`, with a worker of its own beside it killed and started
    again and producers sending duplicates: the embedded PostgreSQL is SIGKILLed, and
    later Redis. Each is restarted in place; nothing published is lost or applied
    twice; `alma up` still serves afterwards, its restarts counted, its services' memory
    watched and the broker's growth warned about (past a threshold set low here). As
    root, it said first which user it adds and which directories it opens."""
    home = tmp_path / "closed"
    home.mkdir(mode=0o700)
    home.chmod(0o700)  # whatever the umask
    up = AlmaUp(  # Tansu: its growth is what alma up warns about (a warning within the test)
        home, ALMA_EMBEDDED_BROKER="tansu", ALMA_EMBEDDED_WARN_PARTITION_RECORDS="10"
    )
    beside: WorkerProcess | None = None
    try:
        endpoints = await up.start()
        settings = load(
            kafka_bootstrap=endpoints["kafka_bootstrap"],
            postgres_dsn=endpoints["postgres_dsn"],
            redis_url=endpoints["redis_url"],
            partitions=4,
            session_timeout_ms=2000,
            heartbeat_interval_ms=200,
            metrics_port=0,
            kafka_idempotence=False,  # Tansu
        )
        dsn = endpoints["postgres_dsn"]
        beside = WorkerProcess(settings, tmp_path / "beside.log").start()
        await beside.wait_started(limit_s=120)
        published: dict[str, list[dict[str, Any]]] = {}
        runs = [f"sup-{i}" for i in range(8)]
        async with Publisher(endpoints["kafka_bootstrap"], settings.lifecycle_topic) as pub:

            async def send(step: int) -> None:
                for run in runs:
                    doc = completed(run, node=f"n{step}", updates={"step": step})
                    published.setdefault(run, []).append(doc)
                    await pub.send(doc)
                    if step % 3 == 0:
                        await pub.send(doc)  # a producer's retry: same event_id
                await pub.flush()

            for step in range(4):
                await send(step)
            postmaster = int(
                (home / ".alma" / "postgres" / "postmaster.pid").read_text().split()[0]
            )
            os.kill(postmaster, signal.SIGKILL)
            for step in range(4, 8):
                await send(step)
                await asyncio.sleep(0.5)
            beside.kill()
            beside.start()

            async def restarted(service: str) -> bool:
                return f"the embedded {service} is back on port" in up.stderr()

            await wait_for(lambda: restarted("PostgreSQL"), what="PostgreSQL back")
            await beside.wait_started(limit_s=120)
            os.kill(up.children()["redis"], signal.SIGKILL)
            for step in range(8, 12):
                await send(step)
                await asyncio.sleep(0.3)
            await wait_for(lambda: restarted("Redis"), what="Redis back")
            for step in range(12, 14):
                await send(step)

        async def all_applied() -> bool:
            total = sum(len(docs) for docs in published.values())
            return await count(dsn, "SELECT count(*) FROM checkpoints") == total

        await wait_for(all_applied, limit_s=90, what="every event applied")
        await assert_exactly_once(dsn, published)
        assert up.running, up.stderr()[-3000:]
        metrics_url = json.loads(up.endpoints_file.read_text())["metrics_url"]
        assert metric(metrics_url, "alma_embedded_restarts_total", service="postgres") == 1
        assert metric(metrics_url, "alma_embedded_restarts_total", service="redis") == 1

        async def watched() -> bool:
            return metric(metrics_url, "alma_embedded_memory_bytes", service="broker") > 0

        await wait_for(watched, limit_s=30, what="the broker's memory watched")

        async def warned() -> bool:
            return "the embedded Kafka broker keeps every record in memory" in up.stderr()

        await wait_for(warned, limit_s=30, what="the warning about the broker's growth")
        assert "use Apache Kafka (`alma up --broker kafka`" in up.stderr()
        records = metric(metrics_url, "alma_embedded_log_records", topic=settings.lifecycle_topic)
        assert records >= 10
        assert beside.terminate() == 0
        beside = None
        err = up.stderr()
        assert "the embedded PostgreSQL stopped (killed by SIGKILL" in err
        assert str(home / ".alma" / "run" / "pg" / "postgres.log") in err
        if os.geteuid() == 0:
            assert f"runs as the system user {PG_USER}" in err
            assert "lets it traverse /" in err
            assert f"{home} (chmod o+x: nothing in them becomes readable)" in err
            assert home.stat().st_mode & stat.S_IXOTH
        else:
            assert "running as root" not in err
            assert not home.stat().st_mode & stat.S_IXOTH
    finally:
        if beside is not None:
            beside.kill()
        code = await up.stop()
    assert code == 0, up.stderr()[-3000:]
    assert not up.endpoints_file.exists()


@pytest.mark.slow
async def test_no_child_outlives_alma_up(tmp_path: Path) -> None:
    """SIGKILL of `alma up` (nothing of its own runs after it): its broker, PostgreSQL
    (with its backends) and Redis end with it; the next `alma up` starts at once."""
    up = AlmaUp(tmp_path)
    await up.start()
    children = up.children()
    assert set(children) == {"broker", "postgres", "redis"}
    assert all(in_group(pid) for pid in children.values())
    assert up.proc is not None
    up.proc.kill()
    up.proc.wait()

    async def all_gone() -> bool:
        return not any(in_group(pid) for pid in children.values())

    await wait_for(all_gone, limit_s=10, what="every child of the killed `alma up` to end")
    again = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "alma_core.cli", "up", "--check"],
        env=up.env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ALMA Stream is up" in again.stdout


def test_leftovers_of_an_earlier_stack_are_ended_and_named(tmp_path: Path) -> None:
    """Where no parent-death signal ended them (another system, an older release), the
    children an earlier stack left are ended at the next start, each named; a recorded
    pid that another program took since is left alone."""
    stack = EmbeddedStack(tmp_path, kafka_bootstrap="127.0.0.1:9", redis_url="redis://x:1/0")
    heard: list[str] = []
    stack.notify = heard.append
    left = subprocess.Popen(["sleep", "60"], start_new_session=True)
    reused = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        stack.children_file.parent.mkdir(parents=True)
        stack.children_file.write_text(
            json.dumps(
                [
                    {"service": "postgres", "pid": left.pid, "cmd": ["sleep", "60"]},
                    {"service": "redis", "pid": reused.pid, "cmd": ["/usr/bin/redis-server"]},
                ]
            )
        )
        assert stack.end_leftovers() == [left.pid]
        assert left.wait(5) == -signal.SIGKILL
        assert reused.poll() is None
        assert heard == [
            f"ended the postgres (pid {left.pid}) that an earlier `alma up` on "
            f"{tmp_path.resolve()} left running when it was killed"
        ]
        assert not stack.children_file.exists()
    finally:
        for proc in (left, reused):
            proc.kill()
            proc.wait()


@pytest.mark.slow
async def test_alma_up_stops_saying_what_was_lost_when_its_broker_dies(tmp_path: Path) -> None:
    """The broker keeps its log in memory: its death is the end of the stack, and
    `alma up` says so with the remedy and exits 1, stopping the rest."""
    up = AlmaUp(tmp_path, ALMA_EMBEDDED_BROKER="tansu")
    await up.start()
    children = up.children()
    os.kill(children["broker"], signal.SIGKILL)
    assert up.proc is not None
    code = await asyncio.to_thread(up.proc.wait, 90)
    err = up.stderr()
    assert code == 1, err[-3000:]
    assert "the embedded Kafka broker stopped while `alma up` was running (killed by SIGKILL" in err
    assert "what was published and not yet applied is gone" in err
    assert "use Apache Kafka (`alma up --broker kafka`" in err
    assert not any(in_group(pid) for pid in children.values())
    assert not up.endpoints_file.exists()


@pytest.mark.slow
async def test_alma_up_with_apache_kafka_restarts_its_broker_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """`alma up --broker kafka`: the broker SIGKILLed mid-stream is started again on its
    log at the same address; every event it acknowledged, before and after, is applied
    once and in order, and the restart is said and counted."""
    up = AlmaUp(tmp_path, ALMA_EMBEDDED_BROKER="kafka")
    try:
        endpoints = await up.start()
        assert endpoints["broker"] == "kafka"
        dsn = endpoints["postgres_dsn"]
        published: dict[str, list[dict[str, Any]]] = {f"kafka-{i}": [] for i in range(6)}
        bootstrap, topic = endpoints["kafka_bootstrap"], "alma.lifecycle.v1"

        async def send(steps: range) -> None:
            async with Publisher(bootstrap, topic) as pub:
                for step in steps:
                    for run, docs in published.items():
                        doc = completed(run, node=f"n{step}", updates={"step": step})
                        docs.append(doc)
                        await pub.send(doc)
                    await pub.flush()  # acknowledged by the broker (acks=all)

        await send(range(5))
        os.kill(up.children()["broker"], signal.SIGKILL)

        async def restarted() -> bool:
            return "the embedded Kafka broker (Apache Kafka) is back on port" in up.stderr()

        await wait_for(restarted, limit_s=60, what="the broker back")
        await send(range(5, 10))

        async def all_applied() -> bool:
            total = sum(len(docs) for docs in published.values())
            return await count(dsn, "SELECT count(*) FROM checkpoints") == total

        await wait_for(all_applied, limit_s=90, what="every acknowledged event applied")
        await assert_exactly_once(dsn, published)
        assert up.running, up.stderr()[-3000:]
        metrics_url = json.loads(up.endpoints_file.read_text())["metrics_url"]
        assert metric(metrics_url, "alma_embedded_restarts_total", service="broker") == 1
        assert "the embedded Kafka broker (Apache Kafka) stopped (killed by SIGKILL" in up.stderr()
    finally:
        code = await up.stop()
    assert code == 0, up.stderr()[-3000:]
