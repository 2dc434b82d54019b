"""The `alma` command line against real services, run as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alma_core.cli.embedded import free_port
from tests.integration.conftest import TEST_PARTITIONS, Topics
from tests.services import Services, without_alma_settings


def alma(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    clean = without_alma_settings()
    return subprocess.run(
        [sys.executable, "-m", "alma_core.cli", *args],
        env={**clean, "COLUMNS": "200", "ALMA_METRICS_PORT": "0", **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_up_with_configured_services_starts_none(
    services: Services, database: str, topics: Topics, tmp_path: Path
) -> None:
    env = {
        "ALMA_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
        "ALMA_POSTGRES_DSN": database,
        "ALMA_REDIS_URL": services.redis_url,
        "ALMA_LIFECYCLE_TOPIC": topics.lifecycle,
        "ALMA_MERGED_TOPIC": topics.merged,
        "ALMA_DLQ_TOPIC": topics.dlq,
        "ALMA_SEQUENCED_TOPIC": topics.sequenced,
        "ALMA_GROUP_PREFIX": f"cli-{topics.lifecycle}",
    }
    result = alma("up", "--check", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "embedded" not in result.stdout
    assert not (tmp_path / ".alma" / "postgres").exists()


def test_db_status_json(database: str) -> None:
    result = alma("db", "status", "--json", env={"ALMA_POSTGRES_DSN": database})
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows[0]["version"] == 1
    assert all(r["applied_at"] for r in rows)


def test_db_downgrade_and_upgrade(database: str) -> None:
    env = {"ALMA_POSTGRES_DSN": database}
    down = alma("db", "downgrade", "--to", "0", env=env)
    assert down.returncode == 0, down.stderr
    assert "reverted 0001_initial" in down.stdout
    status = json.loads(alma("db", "status", "--json", env=env).stdout)
    assert all(r["applied_at"] is None for r in status)
    up = alma("db", "upgrade", env=env)
    assert "applied 0001_initial" in up.stdout
    wrong_way = alma("db", "upgrade", "--to", "0", env=env)
    assert wrong_way.returncode == 1
    assert "use `alma db downgrade`" in wrong_way.stderr


def test_topics_describe_json(services: Services, topics: Topics) -> None:
    env = {
        "ALMA_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
        "ALMA_LIFECYCLE_TOPIC": topics.lifecycle,
        "ALMA_MERGED_TOPIC": topics.merged,
        "ALMA_DLQ_TOPIC": f"{topics.dlq}-missing",
    }
    result = alma("topics", "describe", "--json", env=env)
    infos = {i["name"]: i for i in json.loads(result.stdout)}
    assert infos[topics.lifecycle]["partitions"] == TEST_PARTITIONS
    assert infos[f"{topics.dlq}-missing"]["error"] == "does not exist"
    assert result.returncode == 1
    assert "alma topics create" in result.stderr


def test_bad_settings_and_unreachable_database_explain_themselves() -> None:
    bad = alma("db", "status", env={"ALMA_POSTGRES_DSN": "mysql://nope"})
    assert bad.returncode == 2
    assert "ALMA_POSTGRES_DSN" in bad.stderr
    down = alma("db", "status", env={"ALMA_POSTGRES_DSN": "postgresql://127.0.0.1:1/x"})
    assert down.returncode == 1
    assert "cannot connect to PostgreSQL" in down.stderr
    assert "Traceback" not in down.stderr


def test_schemas_check_and_reducers_list() -> None:
    assert alma("schemas", "export", "--check").returncode == 0
    listed = json.loads(alma("reducers", "list", "--json").stdout)
    assert {"append", "sum", "union", "deep_merge"} <= {r["name"] for r in listed}


def test_version() -> None:
    from importlib import metadata

    result = alma("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"alma {metadata.version('alma-stream')}"


def test_without_the_cli_extra_alma_says_what_to_install() -> None:
    """typer missing, as in an install without the `cli` extra: exit 2 (set-up, like a
    setting: fixed before running again) with the pip command."""
    hide_typer = (
        "import runpy, sys; sys.modules['typer'] = None; "
        "runpy.run_module('alma_core.cli', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_typer, "db", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'alma-stream[cli]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_exit_codes_follow_the_rule(database: str, tmp_path: Path) -> None:
    """0 done; 1 the operation failed (a service that does not answer included), with
    what to do; 2 wrong usage or settings."""
    closed = free_port()
    cases = [
        # (args, env, exit code, what stderr says)
        (
            ("runs", "list"),
            {"ALMA_POSTGRES_DSN": database},
            2,
            "pass --tenant T or set ALMA_TENANT",
        ),
        (
            ("db", "status"),
            {"ALMA_POSTGRES_DSN": f"postgresql://alma@127.0.0.1:{closed}/alma"},
            1,
            "check ALMA_POSTGRES_DSN",
        ),
        (
            ("topics", "describe"),
            {"ALMA_KAFKA_BOOTSTRAP": f"127.0.0.1:{closed}"},
            1,
            "that the broker is running",
        ),
        (
            ("offsets", "reset", "--group", "g", "--topic", "t", "--to-latest"),
            {"ALMA_KAFKA_BOOTSTRAP": f"127.0.0.1:{closed}", "ALMA_POSTGRES_DSN": database},
            1,
            "cannot read the group's offsets",
        ),
        (("topics", "create"), {"ALMA_PARTITIONS": "many"}, 2, "ALMA_PARTITIONS='many'"),
        (("db", "status"), {}, 2, "no `alma up` is running (looked for .alma/endpoints.json in"),
        (
            ("offsets", "reset", "--group", "g", "--topic", "t", "--to-latest", "--to-offset", "1"),
            {},
            2,
            "choose one of --to-latest and --to-offset",
        ),
        (("runs", "show"), {"ALMA_POSTGRES_DSN": database}, 2, "Missing argument"),
        (("db", "status", "--json"), {"ALMA_POSTGRES_DSN": database}, 0, ""),
    ]
    for args, env, code, says in cases:
        result = alma(*args, env=env, cwd=tmp_path)  # no `alma up` endpoints there
        assert result.returncode == code, (args, result.stderr)
        assert says in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_an_unexpected_error_is_one_line_without_a_traceback() -> None:
    """A value no check catches yet (a host name label over 63 characters reaches the
    resolver's IDNA codec): one line that names the error and what to do, not a
    traceback; DEBUG shows it."""
    env = {"ALMA_KAFKA_BOOTSTRAP": f"{'a' * 64}.invalid:9092"}
    result = alma("topics", "describe", env=env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "unexpected UnicodeError" in result.stderr
    assert "ALMA_LOG_LEVEL=DEBUG" in result.stderr
    debug = alma("topics", "describe", env=env | {"ALMA_LOG_LEVEL": "DEBUG"})
    assert debug.returncode == result.returncode
    assert "Traceback" in debug.stderr
