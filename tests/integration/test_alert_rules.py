"""The alert rules and the autoscalers' queries evaluated by promtool (Debian's
prometheus package, installed by `make test`): every alert fires on the series of its
scenario in deploy/prometheus/alerts_test.yml and stays quiet where it must, with the
labels docker compose and Kubernetes give; every runbook link lands on a section of
docs/operations.md; the KEDA queries count each partition once and return nothing
when the lag exporter's figures are stale."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
SCENARIOS = PROMETHEUS / "alerts_test.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
KEDA = ROOT / "deploy" / "k8s" / "autoscaling-keda.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "Debian's promtool is missing: `make test` installs it (apt-get prometheus)"
    return subprocess.run([binary, *args], capture_output=True, text=True, check=False, timeout=60)


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_every_alert_fires_and_stays_quiet_in_its_scenarios() -> None:
    result = promtool("test", "rules", str(SCENARIOS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # promtool checks what the file expects; this checks that it expects enough
    scenarios = yaml.safe_load(SCENARIOS.read_text())
    assert scenarios["rule_files"] == [ALERTS.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in scenarios["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - firing == set(), "alerts without a scenario where they fire"
    assert names - quiet == set(), "alerts without a case where they must not fire"
    assert (firing | quiet) - names == set(), "scenarios for alerts that no longer exist"


def test_a_failing_scenario_fails_promtool(tmp_path: Path) -> None:
    """The scenarios can fail: the old AlmaWorkerDown (job="alma" only) misses the
    Kubernetes pod that is down."""
    old = ALERTS.read_text().replace(
        'up{job="alma"} == 0\n          or\n          up{app_kubernetes_io_name="alma", '
        'app_kubernetes_io_component=~"checkpointer|joiner|learner"} == 0',
        'up{job="alma"} == 0',
    )
    assert old != ALERTS.read_text()
    (tmp_path / ALERTS.name).write_text(old)
    shutil.copy(SCENARIOS, tmp_path / SCENARIOS.name)
    result = promtool("test", "rules", str(tmp_path / SCENARIOS.name))
    assert result.returncode != 0
    assert "a worker down under Kubernetes" in result.stdout + result.stderr


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_runbook_link_lands_on_a_section() -> None:
    headings = re.findall(r"^#{1,6} (.+)$", OPERATIONS.read_text(), flags=re.MULTILINE)
    anchors = {github_anchor(h) for h in headings}
    for rule in alert_rules():
        link = rule["annotations"]["runbook"]
        path, _, anchor = link.partition("#")
        assert path == "docs/operations.md", rule["alert"]
        assert anchor == f"alert-{rule['alert'].lower()}", rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no '### Alert: {rule['alert']}' section"
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]


def test_the_autoscalers_queries_count_each_partition_once_and_refuse_stale_figures(
    tmp_path: Path,
) -> None:
    objects = [d for d in yaml.safe_load_all(KEDA.read_text()) if d]
    assert len(objects) == 3
    tests = []
    for scaled in objects:
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["ignoreNullValues"] == "false"  # empty: fallback
        query = trigger["metadata"]["query"]
        group = re.search(r'consumergroup="([^"]+)"', query)
        assert group, query
        lag = f'kafka_consumergroup_lag{{consumergroup="{group[1]}", topic="t"'
        other = 'kafka_consumergroup_lag{consumergroup="someone-else", topic="t"'
        series = [
            # two partitions, the first reported by two exporters
            {"series": f'{lag}, partition="0", instance="a"}}', "values": "100x10"},
            {"series": f'{lag}, partition="0", instance="b"}}', "values": "100x10"},
            {"series": f'{lag}, partition="1", instance="a"}}', "values": "50x10"},
            {"series": f'{other}, partition="0", instance="a"}}', "values": "9999x10"},
        ]
        fresh = "0+60x10"  # a complete read every minute
        stale = "0x10"  # the last one at t=0
        for last_success, expected in ((fresh, [{"labels": "{}", "value": 150}]), (stale, [])):
            tests.append(
                {
                    "interval": "1m",
                    "input_series": [
                        *series,
                        {
                            "series": "alma_lag_exporter_last_success_timestamp_seconds",
                            "values": last_success,
                        },
                    ],
                    "promql_expr_test": [
                        {"expr": query, "eval_time": "5m", "exp_samples": expected}
                    ],
                }
            )
    (tmp_path / "rules.yml").write_text("groups: []\n")
    scenario = tmp_path / "queries_test.yml"
    scenario.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "tests": tests}))
    result = promtool("test", "rules", str(scenario))
    assert result.returncode == 0, result.stdout + result.stderr
