"""Every metric the Grafana dashboard and the Prometheus alert rules name is produced by
the code, not only declared: a panel or an alert over a series nothing feeds shows
"no data" (or never fires) and looks like health.

One process runs every consumer group and serves reads through the SDK with the
workers' metrics as its observer (as the demo does); after a short workload with a
join, a dead letter, a finished run, a resume and a retrieval, each named metric has
a sample. The ones that only move when something breaks are produced by the tests
that break it (named below), which assert on them; the lag exporter's own are produced
by ``alma lag-exporter`` (``ExporterMetrics``), whose test asserts them.
"""

from __future__ import annotations

import re
from pathlib import Path

from alma_core.consumers.metrics import ExporterMetrics
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.embeddings import AsyncEmbedder
from alma_core.types import RetrievalScope, WorkflowContext
from tests.integration.harness import Publisher, Worker, count, wait_for

DEPLOY = Path(__file__).parents[2] / "deploy"
NAMED_IN = [DEPLOY / "grafana" / "dashboards" / "alma.json", DEPLOY / "prometheus" / "alerts.yml"]
TESTS = Path(__file__).parent

# series -> the test that breaks something on purpose and asserts it moved
ONLY_ON_FAILURE = {
    ("alma_storage_retries_total", "", ""): "test_outages.py",
    ("alma_cache_operations_total", "result", "write_error"): "test_outages.py",
    ("alma_dead_letter_failures_total", "", ""): "test_hostile.py",
    ("alma_offsets_ahead_of_log", "", ""): "test_offsets.py",
    ("alma_outbox_failures_total", "", ""): "test_outbox.py",
    ("alma_offset_commit_failures_total", "", ""): "test_broker_outage.py",
}
EXPORTER_TEST = "test_lag_exporter.py"
# what only tenant topics produce (ALMA_TENANT_TOPICS), and the test that asserts each
WITH_TENANT_TOPICS = {
    "alma_tenant_events_total": "test_tenant_quotas.py",
    "alma_tenant_throttled_total": "test_tenant_quotas.py",
    "alma_tenant_refused_total": "test_tenant_identity.py",
}
# the tenants' storage and blocked runs, read every tenant_settings.REFRESH_S (a tenant's
# gauges appear at the first reading after its first checkpoint, or its first blocked
# run) and refused at a quota; the test that asserts each
AFTER_A_STORAGE_READ = {
    "alma_tenant_storage_bytes": "test_tenant_limits.py",
    "alma_tenant_storage_quota_bytes": "test_tenant_limits.py",
    "alma_tenant_storage_refused_total": "test_tenant_limits.py",
    "alma_runs_blocked": "test_blocked_runs.py",
}
# what only `alma up` produces (its embedded services), and the test that asserts each
UNDER_ALMA_UP = {
    "alma_embedded_restarts_total": "test_embedded.py",
    "alma_embedded_memory_bytes": "test_embedded.py",
    "alma_embedded_log_records": "test_embedded.py",
}


def named_series() -> set[tuple[str, str, str]]:
    """(metric, label, value) for every metric the files name: ``("", "")`` for the
    metric alone, and one triple per value a selector asks for
    (``{result=~"hit|miss"}`` asks for both)."""
    out: set[tuple[str, str, str]] = set()
    for path in NAMED_IN:
        text = path.read_text().replace('\\"', '"')
        for name, selector in re.findall(r"\b(alma_[a-z_]+)(\{[^}]*\})?", text):
            family = re.sub(r"_(bucket|count|sum)$", "", name)
            out.add((family, "", ""))
            for label, values in re.findall(r'(\w+)=~?"([^"]*)"', selector):
                out.update((family, label, value) for value in values.split("|"))
    return out


def produced(worker: Worker) -> set[tuple[str, str, str]]:
    """The same triples for what the code fed: a gauge child that exists, a counter or
    histogram count above zero."""
    out: set[tuple[str, str, str]] = set()
    for family in worker.metrics.registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if family.type != "gauge" and sample.value <= 0:
                continue
            name = re.sub(r"_(bucket|count|sum)$", "", sample.name)
            out.add((name, "", ""))
            out.update((name, label, value) for label, value in sample.labels.items())
    return out


async def test_every_metric_the_dashboard_and_the_alerts_name_is_produced(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    named = named_series()
    # the reader of the files found the metrics and the selectors
    assert len({metric for metric, _, _ in named}) >= 15, named
    assert ("alma_cache_operations_total", "result", "miss") in named
    dsn = settings.postgres_dsn
    assert dsn
    ctx = WorkflowContext("acme", "metrics-wf", None, "metrics-run")
    async with Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder) as worker:
        async with (
            AlmaClient(settings, embedder=embedder, observer=worker.metrics) as client,
            Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as bad,
        ):
            node = WorkflowContext("acme", "metrics-wf", None, "metrics-run", "plan")
            await client.applied(node, await client.node_completed(node, state={"a": 1}))
            for branch in ("x", "y"):
                at = WorkflowContext("acme", "metrics-wf", None, "metrics-run", branch, branch)
                await client.applied(at, await client.node_completed(at, updates={branch: 1}))
            await client.merge(ctx, branch_ids=["x", "y"])
            await bad.send(b"{not json", key="metrics-run")
            await bad.flush()
            await client.workflow_completed(
                ctx,
                success=True,
                duration_ms=10,
                node_count=3,
                nodes_succeeded=3,
                nodes_failed=0,
                task="measure the metrics",
            )

            async def learned() -> bool:
                return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 1

            await wait_for(learned, limit_s=60, what="the outcome")
            # the cache serves it; a read that missed (a rebalance under load invalidated the
            # run's partition after the write) has filled it for the second
            await client.resume(ctx)
            await client.resume(ctx)
            async with RedisCheckpointCache.for_settings(settings) as cache:
                await cache.bump_epoch()  # every partition moved: the cache starts empty
            await client.resume(ctx)  # a miss, from PostgreSQL
            await client.retrieve("measure the metrics", ctx, RetrievalScope.WORKFLOW)
        exporter = {f.name for f in ExporterMetrics().registry.collect()}
        missing = {
            series
            for series in named - produced(worker)
            if series not in ONLY_ON_FAILURE
            and (series[0], "", "") not in ONLY_ON_FAILURE
            and series[0] not in exporter
            and series[0] not in UNDER_ALMA_UP
            and series[0] not in WITH_TENANT_TOPICS
            and series[0] not in AFTER_A_STORAGE_READ
        }
        assert missing == set()
    by_exporter = {metric for metric, _, _ in named if metric in exporter}
    assert by_exporter, "the alerts name the lag exporter's health"
    for metric in by_exporter:
        assert metric in (TESTS / EXPORTER_TEST).read_text(), (
            f"{EXPORTER_TEST} must assert {metric}"
        )
    for metric, test_file in (UNDER_ALMA_UP | WITH_TENANT_TOPICS | AFTER_A_STORAGE_READ).items():
        assert (metric, "", "") in named
        assert metric in (TESTS / test_file).read_text(), f"{test_file} must assert {metric}"
    for (metric, _, value), test_file in ONLY_ON_FAILURE.items():
        assert (metric, "", "") in named
        text = (TESTS / test_file).read_text()
        assert metric in text, f"{test_file} must assert {metric}"
        assert value in text, f"{test_file} must assert {metric} {value}"
