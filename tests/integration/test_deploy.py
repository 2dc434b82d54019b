"""The deployment files checked against the code: alert rules with promtool, every
metric a rule or a panel names exists, docker-compose and the Kubernetes manifests
hold what the code expects (no Docker engine here: parsed, not run)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from alma_core.settings import Settings
from consumers.metrics import Metrics

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"


def exported_names() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        for sample in family.samples:
            names.add(sample.name)
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
    return names


def referenced(text: str) -> set[str]:
    return set(re.findall(r"\b(alma_[a-z_]+)", text))


def settings_variables() -> set[str]:
    return {f"ALMA_{name.upper()}" for name in Settings.model_fields}


def test_alert_rules_pass_promtool() -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_every_metric_in_rules_and_dashboard_exists() -> None:
    exported = exported_names()
    rules = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "alma.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for source, names in (("alerts.yml", referenced(rules)), ("dashboard", referenced(exprs))):
        missing = sorted(n for n in names if n not in exported)
        assert not missing, f"{source} names metrics the code does not export: {missing}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for panel in (
        "throughput",
        "end-to-end lag",
        "lag per partition",
        "dead letters",
        "checkpoint write",
        "merge time",
        "cache",
    ):
        assert panel in titles


def test_docker_compose_services_and_settings() -> None:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {
        "kafka",
        "postgres",
        "redis",
        "prometheus",
        "grafana",
        "init",
        "checkpointer",
        "joiner",
        "learner",
    } <= set(services)
    assert "KAFKA_PROCESS_ROLES" in services["kafka"]["environment"]  # KRaft, no ZooKeeper
    assert services["postgres"]["image"] == "pgvector/pgvector:pg18"  # as the embedded stack
    # acknowledged events survive `docker compose down`: the log is in a named volume
    kafka = services["kafka"]
    log_dirs = kafka["environment"]["KAFKA_LOG_DIRS"]
    assert any(v.split(":")[1] == log_dirs for v in kafka["volumes"])
    assert {v.split(":")[0] for v in kafka["volumes"]} <= set(compose["volumes"])
    retention_days = kafka["environment"]["KAFKA_LOG_RETENTION_HOURS"] / 24
    assert retention_days < Settings.model_fields["run_retention_days"].default
    known = settings_variables()
    for name in ("init", "checkpointer", "joiner", "learner"):
        env = services[name]["environment"]
        assert set(env) <= known, f"{name}: unknown settings {set(env) - known}"
        assert {"ALMA_KAFKA_BOOTSTRAP", "ALMA_POSTGRES_DSN", "ALMA_REDIS_URL"} <= set(env)
    for name in ("kafka", "postgres", "redis", "checkpointer", "joiner", "learner", "prometheus"):
        assert "healthcheck" in services[name], name
    assert services["checkpointer"]["command"] == ["worker", "--consumers", "checkpointer"]
    assert services["joiner"]["command"] == ["worker", "--consumers", "joiner"]
    assert services["learner"]["command"] == ["worker", "--consumers", "learner"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    sd = prometheus["scrape_configs"][0]["dns_sd_configs"][0]
    assert set(sd["names"]) == {"checkpointer", "joiner", "learner"}
    assert sd["port"] == Settings.model_fields["metrics_port"].default


def test_kubernetes_manifests() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "workers.yaml").read_text()) if d]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    assert set(deployments) == {"alma-checkpointer", "alma-joiner", "alma-learner"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert container["args"] == ["worker", "--consumers", name.removeprefix("alma-")]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"], name
    assert {p["metadata"]["name"] for p in by_kind["PodDisruptionBudget"]} == set(deployments)
    (hpa,) = by_kind["HorizontalPodAutoscaler"]
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] in exported_names()
    (config,) = by_kind["ConfigMap"]
    assert set(config["data"]) <= settings_variables()
