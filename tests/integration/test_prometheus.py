"""A real Prometheus server (Debian's package, installed by `make test`) scrapes a
running worker: during a short load its HTTP API must show the work done, the lag back
at zero and ALMA's alert rules loaded; with the Kubernetes scrape config's relabeling
(deploy/prometheus/kubernetes.yml, fed pod metadata through file discovery, since
Debian's build has no Kubernetes discovery) the worker's series carry the pod's
labels, and AlmaWorkerDown goes pending for a pod that does not answer, as it does for
a docker compose target (job="alma")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from alma_core.cli.embedded import free_port
from alma_core.settings import Settings
from tests.integration.harness import Publisher, Worker, completed, count, wait_for

PROMETHEUS_DIR = Path(__file__).parents[2] / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@contextlib.asynccontextmanager
async def running_prometheus(
    tmp_path: Path, scrape_configs: list[dict[str, Any]]
) -> AsyncIterator[str]:
    """A Prometheus with ALMA's rules, scraping and evaluating every second; yields its
    base URL."""
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is missing: `make test` installs it (apt-get)"
    for job in scrape_configs:
        job.setdefault("scrape_interval", "1s")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(ALERTS)],
                "scrape_configs": scrape_configs,
            }
        )
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


@pytest.fixture
async def prometheus(worker: Worker, tmp_path: Path) -> AsyncIterator[str]:
    target = f"127.0.0.1:{worker.status.http_port}"
    jobs: list[dict[str, Any]] = [{"job_name": "alma", "static_configs": [{"targets": [target]}]}]
    async with running_prometheus(tmp_path, jobs) as base:
        yield base


async def query_all(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    result: list[dict[str, Any]] = (await asyncio.to_thread(_get, url))["data"]["result"]
    return result


async def query(base: str, expr: str) -> float | None:
    result = await query_all(base, expr)
    return float(result[0]["value"][1]) if result else None


async def alerts(base: str) -> list[dict[str, Any]]:
    answer = await asyncio.to_thread(_get, f"{base}/api/v1/alerts")
    found: list[dict[str, Any]] = answer["data"]["alerts"]
    return found


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
    # the process metrics the dashboard and AlmaFileDescriptorsNearLimit read
    assert (await query(prometheus, 'process_open_fds{job="alma"}') or 0) > 0
    assert (await query(prometheus, 'process_resident_memory_bytes{job="alma"}') or 0) > 0
    rules = await asyncio.to_thread(_get, f"{prometheus}/api/v1/rules")
    names = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
    in_file = yaml.safe_load(ALERTS.read_text())["groups"]
    assert names == {r["alert"] for g in in_file for r in g["rules"]}
    assert {"AlmaConsumerLagGrowing", "AlmaWorkerDown", "AlmaOutboxFailing"} <= names
    assert all(r["health"] == "ok" for g in rules["data"]["groups"] for r in g["rules"])


def pod(address: str, port: int, component: str, name: str, **meta: str) -> dict[str, Any]:
    """A file-discovery target with the metadata Kubernetes pod discovery gives a pod."""
    labels = {
        "__meta_kubernetes_namespace": "alma",
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": "alma",
        "__meta_kubernetes_pod_label_app_kubernetes_io_component": component,
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
        "__meta_kubernetes_pod_annotation_prometheus_io_port": str(port),
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
    }
    labels.update({f"__meta_kubernetes_pod_{k}": v for k, v in meta.items()})
    return {"targets": [address], "labels": labels}


async def test_kubernetes_relabeling_keeps_the_pod_labels_the_alerts_match(
    worker: Worker, tmp_path: Path
) -> None:
    (job,) = yaml.safe_load((PROMETHEUS_DIR / "kubernetes.yml").read_text())["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    targets = tmp_path / "pods.json"
    job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "1s"}]
    del job["kubernetes_sd_configs"]
    dead = free_port()  # nothing listens there
    targets.write_text(
        json.dumps(
            [
                # the address pod discovery gives is the container port's; the
                # annotation names the one to scrape
                pod("127.0.0.1:1", worker.status.http_port, "checkpointer", "alma-ckpt-0"),
                pod("127.0.0.1:1", dead, "learner", "alma-learner-0"),
                pod("127.0.0.1:2", dead, "migrate", "alma-migrate-0", phase="Succeeded"),
                pod("127.0.0.1:3", dead, "api", "other-0", annotation_prometheus_io_scrape="no"),
            ]
        )
    )
    compose_dead = {"job_name": "alma", "static_configs": [{"targets": [f"127.0.0.1:{dead}"]}]}
    async with running_prometheus(tmp_path, [job, compose_dead]) as base:
        alive = (
            'up{job="kubernetes-pods", app_kubernetes_io_name="alma", '
            'app_kubernetes_io_component="checkpointer", namespace="alma", pod="alma-ckpt-0", '
            f'instance="127.0.0.1:{worker.status.http_port}"}}'
        )

        async def scraped() -> bool:
            return await query(base, alive) == 1

        await wait_for(scraped, what="the worker scraped as a pod")

        # only the annotated, running pods are targets (each scraped on its own schedule)
        async def pods() -> set[str]:
            return {r["metric"]["pod"] for r in await query_all(base, 'up{job="kubernetes-pods"}')}

        async def both_scraped() -> bool:
            return len(await pods()) >= 2

        await wait_for(both_scraped, limit_s=30, what="both pods' up series")
        assert await pods() == {"alma-ckpt-0", "alma-learner-0"}
        # the worker's own series carry the pod's labels too
        fds = await query_all(base, 'process_open_fds{app_kubernetes_io_name="alma"}')
        assert [r["metric"]["app_kubernetes_io_component"] for r in fds] == ["checkpointer"]

        async def worker_down_pending() -> bool:
            down = [a for a in await alerts(base) if a["labels"]["alertname"] == "AlmaWorkerDown"]
            return {(a["labels"].get("pod"), a["labels"]["instance"]) for a in down} == {
                ("alma-learner-0", f"127.0.0.1:{dead}"),  # Kubernetes: the pod's labels
                (None, f"127.0.0.1:{dead}"),  # docker compose: job="alma"
            }

        await wait_for(worker_down_pending, what="AlmaWorkerDown for both dead targets")
        down = [a for a in await alerts(base) if a["labels"]["alertname"] == "AlmaWorkerDown"]
        assert {a["state"] for a in down} == {"pending"}  # for: 2m
        assert not [a for a in down if a["labels"].get("pod") == "alma-ckpt-0"]
