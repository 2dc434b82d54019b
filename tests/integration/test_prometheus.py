"""A real Prometheus server (Debian's package, installed by `make test`) scrapes a
running worker during a short load; its HTTP API must show the work done, the lag
back at zero, and ALMA's alert rules loaded."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from alma_core.cli.embedded import free_port
from alma_core.settings import Settings
from tests.integration.harness import Publisher, Worker, completed, count, wait_for

ALERTS = Path(__file__).parents[2] / "deploy" / "prometheus" / "alerts.yml"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
async def prometheus(worker: Worker, tmp_path: Path) -> AsyncIterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is missing: `make test` installs it (apt-get)"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{ALERTS}]\n"
        "scrape_configs:\n"
        "  - job_name: alma\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{worker.status.http_port}']}}]\n"
    )
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> bool:
            try:
                await asyncio.to_thread(urllib.request.urlopen, f"{base}/-/ready", None, 2)
                return True
            except OSError:
                return False

        await wait_for(ready, limit_s=30, what="Prometheus to be ready")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


async def query(base: str, expr: str) -> float | None:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    result = (await asyncio.to_thread(_get, url))["data"]["result"]
    return float(result[0]["value"][1]) if result else None


async def test_prometheus_sees_the_work_and_the_lag_drains(
    settings: Settings, worker: Worker, prometheus: str
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for i in range(40):
            await pub.send(completed(f"run-{i % 8}", updates={"i": i}))
        for _ in range(2):
            await pub.send(b"not json", key=b"run-0")
        await pub.flush()

    async def processed() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints") == 40

    await wait_for(processed, what="the checkpoints")

    async def scraped(expr: str, expected: float) -> bool:
        return await query(prometheus, expr) == expected

    await wait_for(lambda: scraped('up{job="alma"}', 1), what="the worker to be scraped")
    await wait_for(lambda: scraped("sum(alma_checkpoints_total)", 40), what="40 checkpoints")
    await wait_for(lambda: scraped("sum(alma_dead_letters_total)", 2), what="2 dead letters")
    await wait_for(
        lambda: scraped('sum(alma_events_total{type="node.completed"})', 40), what="40 events"
    )
    await wait_for(lambda: scraped("max(alma_consumer_lag)", 0), what="the lag back at zero")
    rules = await asyncio.to_thread(_get, f"{prometheus}/api/v1/rules")
    names = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
    assert {
        "AlmaConsumerLagGrowing",
        "AlmaDeadLetterUnstorable",
        "AlmaLogBehindStoredOffsets",
    } <= names
    assert len(names) == 8
