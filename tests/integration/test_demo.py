"""`alma demo`, the README's first command, on configured services: every feature it
shows is checked in its JSON summary (the in-process workers load the real model)."""

from __future__ import annotations

import json
from pathlib import Path

from alma_core.settings import Settings
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of


def test_demo_workflows_to_its_summary(settings: Settings, tmp_path: Path) -> None:
    env = {**env_of(settings), "ALMA_DATA_DIR": str(tmp_path)}
    result = alma("demo", "--runs", "10", "--json", env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    counts = doc["counts"]
    assert counts["runs"] == 10
    assert counts["outcomes"] == 10
    assert doc["succeeded"] == 9
    assert doc["failed"] == 1
    assert doc["resumed"] == 2  # runs 2 and 8 crash after the join and resume
    assert counts["joins"] == 8  # one per research run; invoices have none
    assert doc["stale_writes_refused"] == 2
    assert counts["dead letters"] == 2
    sent, counted = doc["concurrent_increments"]
    assert sent == counted == 8
    assert doc["retrieval"]["items"], "the demo retrieves what was learned"
    assert doc["metrics_url"].endswith("/metrics")
