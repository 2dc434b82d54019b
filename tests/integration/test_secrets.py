"""No password leaves the command line: real failures (a closed port, a wrong password
refused by a real PostgreSQL, a malformed DSN, a running `alma up` with a password in
its DSN), every line of stdout and stderr searched for the password, and each output
checked to say what failed (so an empty output cannot pass)."""

from __future__ import annotations

import asyncio
import json
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from alma_core.cli.embedded import Postgres, free_port
from tests.integration.conftest import Topics
from tests.integration.test_cli import alma
from tests.services import Services, without_alma_settings

SECRET = "S3cretPW"  # the role's real password
WRONG = "Wr0ngPW77"  # a password PostgreSQL refuses
ROLE = "alma_secret"


@dataclass(frozen=True)
class PasswordPostgres:
    """A PostgreSQL of this module alone where ROLE logs in with a password (the
    session's PostgreSQL trusts every connection, so it would accept any password)."""

    port: int

    def dsn(self, password: str) -> str:
        return f"postgresql://{ROLE}:{password}@127.0.0.1:{self.port}/alma"


@pytest.fixture(scope="module")
async def password_pg(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PasswordPostgres]:
    base = tmp_path_factory.mktemp("password-pg")
    pg = Postgres(base / "data", base / "run", durable=False)
    await pg.start()
    try:
        conn = await asyncpg.connect(pg.dsn("postgres"))
        try:
            await conn.execute(f"CREATE ROLE {ROLE} LOGIN SUPERUSER PASSWORD '{SECRET}'")
            hba = pg.data_dir / "pg_hba.conf"
            rule = f"host all {ROLE} 127.0.0.1/32 scram-sha-256\n"
            hba.write_text(rule + hba.read_text())  # first match wins
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()
        yield PasswordPostgres(pg.port)
    finally:
        await pg.stop()


def assert_masked(output: str, *secrets: str) -> None:
    for number, line in enumerate(output.splitlines(), 1):
        for secret in secrets:
            assert secret not in line, f"line {number} shows the password: {line}"


def closed_port_dsn() -> str:
    return f"postgresql://alma:{SECRET}@127.0.0.1:{free_port()}/db"


def readyz_while(env: dict[str, str], seconds: float) -> tuple[str, str]:
    """`alma worker` for ``seconds``: its output and its /readyz answer, then SIGTERM."""
    clean = without_alma_settings()
    proc = subprocess.Popen(
        [sys.executable, "-m", "alma_core.cli", "worker", "--consumers", "checkpointer"],
        env={**clean, "ALMA_LOG_FORMAT": "json", "ALMA_METRICS_PORT": "0", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    answer = ""
    deadline = time.monotonic() + seconds
    try:
        for line in proc.stdout:
            lines.append(line)
            if '"http_listen"' in line:
                port = json.loads(line)["port"]
                time.sleep(2)  # a retry or two, so /readyz holds the last error
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5):
                        pass
                except urllib.error.HTTPError as exc:  # 503 while waiting: the body says why
                    answer = exc.read().decode()
            if answer or time.monotonic() > deadline:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    return "".join(lines) + rest, answer


async def test_a_worker_retrying_an_unreachable_postgres_never_logs_the_password(
    services: Services,
) -> None:
    env = {
        "ALMA_POSTGRES_DSN": closed_port_dsn(),
        "ALMA_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
        "ALMA_REDIS_URL": services.redis_url,
    }
    output, readyz = await asyncio.to_thread(readyz_while, env, 30)
    assert_masked(output + readyz, SECRET)
    assert '"postgres_retry"' in output, output[-3000:]
    assert "PostgreSQL unreachable" in output
    assert "postgresql://alma:***@127.0.0.1" in output
    assert "postgres" in readyz, readyz
    assert "alma:***@" in readyz, readyz


async def test_a_worker_refused_by_postgres_never_logs_the_password(
    services: Services, password_pg: PasswordPostgres
) -> None:
    env = {
        "ALMA_POSTGRES_DSN": password_pg.dsn(WRONG),
        "ALMA_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
        "ALMA_REDIS_URL": services.redis_url,
    }
    output, readyz = await asyncio.to_thread(readyz_while, env, 30)
    assert_masked(output + readyz, WRONG, SECRET)
    assert f'password authentication failed for user \\"{ROLE}\\"' in output, output[-3000:]
    assert "password authentication failed" in readyz, readyz


@pytest.mark.parametrize(
    "args",
    [
        ("db", "status"),
        ("runs", "list", "--tenant", "acme"),
        ("offsets", "list"),
        ("dlq", "list"),
        ("checkpoints", "some-run", "--tenant", "acme"),
    ],
)
async def test_commands_that_cannot_connect_never_print_the_password(
    password_pg: PasswordPostgres, args: tuple[str, ...]
) -> None:
    for dsn, why in (
        (closed_port_dsn(), "Connect call failed"),
        (password_pg.dsn(WRONG), "password authentication failed"),
    ):
        result = await asyncio.to_thread(alma, *args, env={"ALMA_POSTGRES_DSN": dsn})
        assert_masked(result.stdout + result.stderr, SECRET, WRONG)
        assert result.returncode == 1, result.stderr
        assert why in result.stderr
        assert "cannot connect to PostgreSQL at postgresql://" in result.stderr
        assert ":***@127.0.0.1" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("dsn", "says"),
    [
        (f"postgresql://alma:{SECRET}@localhost:notaport/db", "port 'notaport' is not a number"),
        (f"mysql://alma:{SECRET}@localhost/db", "expected a URL starting postgresql://"),
        (f"postgresql://alma:{SECRET}@h1:5432,h2:zz/db", "port 'zz' is not a number"),
    ],
)
async def test_a_malformed_dsn_is_one_line_naming_the_variable(dsn: str, says: str) -> None:
    result = await asyncio.to_thread(alma, "db", "status", env={"ALMA_POSTGRES_DSN": dsn})
    assert_masked(result.stdout + result.stderr, SECRET)
    assert result.returncode == 2, result.stderr
    assert "ALMA_POSTGRES_DSN" in result.stderr
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow
async def test_alma_up_masks_its_table_and_keeps_the_real_dsn_for_its_owner(
    services: Services, topics: Topics, password_pg: PasswordPostgres, tmp_path: Path
) -> None:
    env = {
        "ALMA_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
        "ALMA_POSTGRES_DSN": password_pg.dsn(SECRET),
        "ALMA_REDIS_URL": services.redis_url,
        "ALMA_LIFECYCLE_TOPIC": topics.lifecycle,
        "ALMA_MERGED_TOPIC": topics.merged,
        "ALMA_DLQ_TOPIC": topics.dlq,
        "ALMA_SEQUENCED_TOPIC": topics.sequenced,
        "ALMA_GROUP_PREFIX": f"secrets-{topics.lifecycle}",
        "ALMA_METRICS_PORT": "0",
        "COLUMNS": "200",
    }
    clean = without_alma_settings()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "alma_core.cli",
        "up",
        env={**clean, **env},
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    endpoints = tmp_path / ".alma" / "endpoints.json"
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.returncode is None:
            if endpoints.exists() and "metrics_url" in endpoints.read_text():
                break
            await asyncio.sleep(0.2)
        assert proc.returncode is None, "alma up exited early"
        mode = stat.S_IMODE(endpoints.stat().st_mode)
        assert mode == 0o600, oct(mode)
        # other processes connect with it: the real DSN, password included
        assert json.loads(endpoints.read_text())["postgres_dsn"] == password_pg.dsn(SECRET)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        raw_out, raw_err = await asyncio.wait_for(proc.communicate(), 120)
    out, err = raw_out.decode(), raw_err.decode()
    assert proc.returncode == 0, err[-3000:]
    assert_masked(out + err, SECRET)
    assert f"postgresql://{ROLE}:***@127.0.0.1:{password_pg.port}/alma" in out
    assert "ALMA Stream is up" in out
    assert "readable by its owner only" in out


async def test_a_malformed_redis_url_is_one_line_naming_the_variable(database: str) -> None:
    result = await asyncio.to_thread(
        alma,
        "resume",
        "some-run",
        "--tenant",
        "acme",
        env={
            "ALMA_POSTGRES_DSN": database,
            "ALMA_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:notaport/0",
        },
    )
    assert_masked(result.stdout + result.stderr, SECRET)
    assert result.returncode == 2, result.stderr
    assert "ALMA_REDIS_URL='redis://:***@127.0.0.1:notaport/0'" in result.stderr
    assert "port 'notaport' is not a number from 1 to 65535" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
