"""The `alma` command line against real services, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import TEST_PARTITIONS, Topics
from tests.services import Services


def alma(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ALMA_")}
    return subprocess.run(
        [sys.executable, "-m", "alma_core.cli", *args],
        env={**clean, "COLUMNS": "200", "ALMA_METRICS_PORT": "0", **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_up_check_starts_and_stops_the_embedded_stack(tmp_path: Path) -> None:
    result = alma("up", "--check", "--partitions", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ALMA Stream is up" in result.stdout
    assert "3 partitions" in result.stdout
    assert "stopped" in result.stdout
    assert (tmp_path / ".alma" / "postgres" / "PG_VERSION").exists()
    assert not (tmp_path / ".alma" / "endpoints.json").exists()
    # A second start reuses the data directory (the schema is already there).
    again = alma("up", "--check", cwd=tmp_path)
    assert again.returncode == 0, again.stderr


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
