"""Settings name the bad variable; the workflow context checks its hierarchy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from alma_core import errors
from alma_core import settings as settings_mod
from alma_core.settings import load, load_running, with_running
from alma_core.types import WorkflowContext


def test_bad_setting_names_variable_value_and_expectation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALMA_PARTITIONS", "many")
    with pytest.raises(errors.ConfigError, match=r"ALMA_PARTITIONS='many'.*integer"):
        load()


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("ALMA_POSTGRES_DSN", "mysql://x", "postgresql://"),
        ("ALMA_REDIS_URL", "http://x", "redis://"),
        ("ALMA_KAFKA_BOOTSTRAP", "localhost", "host:port"),
        ("ALMA_KAFKA_BOOTSTRAP", "localhost:²", "host:port"),  # a digit int() refuses
        ("ALMA_KAFKA_BOOTSTRAP", "localhost:99999", "host:port"),
        ("ALMA_MAX_STATE_BYTES", "10", "greater than or equal"),
    ],
)
def test_service_urls_are_checked(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(errors.ConfigError, match=var) as info:
        load()
    assert expected in info.value.message


@pytest.mark.parametrize(
    ("dsn", "port"),
    [
        ("postgresql://alma:S3cretPW@localhost:notaport/db", "notaport"),
        ("postgresql://alma:S3cretPW@h1:5432,h2:zz/db", "zz"),
        ("postgresql://alma:S3cretPW@localhost:99999/db", "99999"),  # asyncpg wraps it
        ("postgresql://alma:S3cretPW@[::1]:x/db", "x"),
        ("postgresql://alma:S3cretPW@localhost:²/db", "²"),  # isdigit, yet not int()'s
    ],
)
def test_a_malformed_dsn_port_is_a_settings_error_without_the_password(
    monkeypatch: pytest.MonkeyPatch, dsn: str, port: str
) -> None:
    monkeypatch.setenv("ALMA_POSTGRES_DSN", dsn)
    with pytest.raises(errors.ConfigError, match="ALMA_POSTGRES_DSN") as info:
        load()
    assert f"port {port!r} is not a number from 1 to 65535" in info.value.message
    assert "S3cretPW" not in info.value.message


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://alma:p:w@[::1]:5432/db",
        "postgresql://alma@h1:5432,h2/db?sslmode=require",
        "postgresql:///db?host=/var/run/postgresql",
        "postgres://alma:pw@db.internal/alma",
    ],
)
def test_well_formed_dsns_pass(monkeypatch: pytest.MonkeyPatch, dsn: str) -> None:
    monkeypatch.setenv("ALMA_POSTGRES_DSN", dsn)
    assert load().postgres_dsn == dsn


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("redis://:S3cretPW@cache:6379/0", True),
        ("rediss://cache", True),
        ("redis://[::1]:6380/1", True),
        ("unix:///run/redis.sock", True),
        ("redis://a:7000,redis://b:7001", True),
        ("redis://:S3cretPW@cache:99999/0", False),
        ("redis://cache:abc", False),
        ("redis://a:7000,redis://b:0", False),
        ("redis://cache:٣٣", False),  # decimal digits, not ASCII ones
    ],
)
def test_redis_url_ports_are_checked(monkeypatch: pytest.MonkeyPatch, url: str, ok: bool) -> None:
    monkeypatch.setenv("ALMA_REDIS_URL", url)
    if ok:
        assert load().redis_url == url
        return
    with pytest.raises(errors.ConfigError, match="ALMA_REDIS_URL") as info:
        load()
    assert "is not a number from 1 to 65535" in info.value.message
    assert "S3cretPW" not in info.value.message


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ALMA_KAFKA_BOOTSTRAP", "ALMA_POSTGRES_DSN", "ALMA_REDIS_URL"):
        monkeypatch.delenv(var, raising=False)
    s = load()
    assert s.lifecycle_topic == "alma.lifecycle.v1"
    assert s.partitions == 12
    assert s.max_state_bytes == 1_000_000
    assert (s.kafka_bootstrap, s.postgres_dsn, s.redis_url) == (None, None, None)


def test_retention_defaults_bound_every_table_and_run_rows_go_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = load().retention
    assert (policy.checkpoints_days, policy.events_days, policy.runs_days) == (30, 30, 90)
    assert (policy.dead_letters_days, policy.outcome_memories_days) == (30, 180)
    assert policy.superseded_days == 30
    # deleting run rows before (or without) pruning their events would let a replay in
    monkeypatch.setenv("ALMA_EVENT_RETENTION_DAYS", "0")
    with pytest.raises(errors.ConfigError, match="ALMA_EVENT_RETENTION_DAYS=0") as info:
        load()
    assert "set it to 0 to keep run rows" in info.value.message
    monkeypatch.setenv("ALMA_EVENT_RETENTION_DAYS", "120")
    with pytest.raises(errors.ConfigError, match="ALMA_EVENT_RETENTION_DAYS=120"):
        load()
    monkeypatch.setenv("ALMA_RUN_RETENTION_DAYS", "0")  # run rows kept: any order is fine
    assert load().retention.events_days == 120
    for var in ("CHECKPOINT", "EVENT", "DEAD_LETTER", "OUTCOME_MEMORY", "SUPERSEDED"):
        monkeypatch.setenv(f"ALMA_{var}_RETENTION_DAYS", "0")
    assert not load().retention.active


def test_context_hierarchy() -> None:
    WorkflowContext("t", "w", None, "r", "n").validate(require_tenant=True)
    with pytest.raises(errors.ContextError, match="run_id requires workflow_id"):
        WorkflowContext(tenant_id="t", run_id="r").validate()
    with pytest.raises(errors.ContextError, match="node_id requires run_id"):
        WorkflowContext(tenant_id="t", workflow_id="w", node_id="n").validate()
    with pytest.raises(errors.ContextError, match="ALMA_REQUIRE_TENANT"):
        WorkflowContext(workflow_id="w").validate(require_tenant=True)
    WorkflowContext(workflow_id="w").validate(require_tenant=False)


def test_to_env_makes_another_process_load_the_same_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = load(
        postgres_dsn="postgresql://u@h:5/db", partitions=7, fetch_max_wait_ms=20, redis_prefix="p"
    )
    for name in list(os.environ):
        if name.startswith("ALMA_"):
            monkeypatch.delenv(name)
    for name, value in original.to_env().items():
        monkeypatch.setenv(name, value)
    assert load() == original


def test_load_running_takes_the_unset_services_from_alma_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in list(os.environ):
        if name.startswith("ALMA_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ALMA_DATA_DIR", str(tmp_path))
    with pytest.raises(errors.ConfigError, match="no `alma up` is running") as info:
        load_running()  # no alma up, no service set: it says where it looked
    assert f"looked in {tmp_path / 'endpoints.json'} (ALMA_DATA_DIR)" in info.value.message
    (tmp_path / "endpoints.json").write_text(
        json.dumps(
            {
                "kafka_bootstrap": "127.0.0.1:9092",
                "postgres_dsn": "postgresql://u@127.0.0.1:5432/alma",
                "redis_url": "redis://127.0.0.1:6379/0",
            }
        )
    )
    monkeypatch.setenv("ALMA_REDIS_URL", "redis://10.0.0.9:6379/0")
    loaded = load_running()
    assert (loaded.kafka_bootstrap, loaded.postgres_dsn, loaded.redis_url) == (
        "127.0.0.1:9092",
        "postgresql://u@127.0.0.1:5432/alma",
        "redis://10.0.0.9:6379/0",  # a variable wins over alma up's
    )


def test_load_running_ignores_the_endpoints_of_an_alma_up_that_is_gone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An ``alma up`` killed without its clean-up leaves its endpoints file: its ports
    are closed (or another program's), so an application must not take them."""
    for name in list(os.environ):
        if name.startswith("ALMA_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ALMA_DATA_DIR", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names no process
    endpoints = {"kafka_bootstrap": "127.0.0.1:9092", "fetch_max_wait_ms": 7}
    (tmp_path / "endpoints.json").write_text(json.dumps({**endpoints, "pid": gone.pid}))
    with pytest.raises(errors.ConfigError, match="no `alma up` is running"):
        load_running()
    assert with_running(load()).fetch_max_wait_ms == 500
    (tmp_path / "endpoints.json").write_text(json.dumps({**endpoints, "pid": os.getpid()}))
    assert load_running().kafka_bootstrap == "127.0.0.1:9092"  # a running one's are taken


def test_a_topic_that_outlives_run_rows_is_a_replay_problem() -> None:
    policy = load().retention  # run rows live 90 days
    day = 86_400_000
    assert policy.replay_problem("t", 7 * day) is None
    assert "keeps records 120 days" in (policy.replay_problem("t", 120 * day) or "")
    assert "keeps records forever" in (policy.replay_problem("t", -1) or "")
    keep_rows = replace(policy, runs_days=0)
    assert keep_rows.replay_problem("t", -1) is None


def test_the_embedded_broker_gets_a_short_fetch_wait_unless_one_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The embedded broker does not wake a waiting fetch: alma up, its workers and the
    applications beside it (load_running) use EMBEDDED_FETCH_MAX_WAIT_MS; a broker of
    one's own keeps the default, and ALMA_FETCH_MAX_WAIT_MS always wins."""
    monkeypatch.delenv("ALMA_FETCH_MAX_WAIT_MS", raising=False)
    monkeypatch.delenv("ALMA_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("ALMA_DATA_DIR", str(tmp_path))
    s = settings_mod.load()
    assert settings_mod.for_broker(s, embedded=False).fetch_max_wait_ms == 500
    embedded = settings_mod.for_broker(s, embedded=True)
    assert embedded.fetch_max_wait_ms == settings_mod.EMBEDDED_FETCH_MAX_WAIT_MS
    (tmp_path / settings_mod.ENDPOINTS_FILE).write_text(
        json.dumps({"kafka_bootstrap": "127.0.0.1:9", "fetch_max_wait_ms": 7})
    )
    assert settings_mod.load_running().fetch_max_wait_ms == 7
    monkeypatch.setenv("ALMA_KAFKA_BOOTSTRAP", "127.0.0.1:19092")  # a broker of one's own
    assert settings_mod.load_running().fetch_max_wait_ms == 500
    monkeypatch.setenv("ALMA_FETCH_MAX_WAIT_MS", "50")
    monkeypatch.delenv("ALMA_KAFKA_BOOTSTRAP")
    assert settings_mod.load_running().fetch_max_wait_ms == 50
    assert settings_mod.for_broker(settings_mod.load(), embedded=True).fetch_max_wait_ms == 50
    # idle, alma up's consumers wait longer on either broker (bench --only hop), unless
    # told; a broker of one's own keeps the default (no idle pace)
    assert embedded.fetch_idle_wait_ms == settings_mod.EMBEDDED_FETCH_IDLE_WAIT_MS
    kafka = settings_mod.for_broker(s, embedded=False)
    assert kafka.fetch_idle_wait_ms == settings_mod.EMBEDDED_FETCH_IDLE_WAIT_MS
    assert (kafka.fetch_max_wait_ms, kafka.kafka_idempotence) == (500, True)
    assert s.fetch_idle_wait_ms == 0
    monkeypatch.setenv("ALMA_FETCH_IDLE_WAIT_MS", "0")
    assert settings_mod.for_broker(settings_mod.load(), embedded=True).fetch_idle_wait_ms == 0


def test_producers_are_idempotent_except_on_tansu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Idempotence is on by default (Apache Kafka); alma up's Tansu and the applications
    beside it turn it off (Tansu answers UnknownError); an alma up on Apache Kafka leaves
    it on, and ALMA_KAFKA_IDEMPOTENCE always wins."""
    for name in ("ALMA_KAFKA_IDEMPOTENCE", "ALMA_KAFKA_BOOTSTRAP", "ALMA_FETCH_MAX_WAIT_MS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ALMA_DATA_DIR", str(tmp_path))
    s = settings_mod.load()
    assert s.kafka_idempotence is True
    assert settings_mod.for_broker(s, embedded=True).kafka_idempotence is False
    assert settings_mod.for_broker(s, embedded=False).kafka_idempotence is True
    endpoints = tmp_path / settings_mod.ENDPOINTS_FILE
    for broker, idempotent, wait in (("tansu", False, 20), ("kafka", True, 100), (None, False, 20)):
        shown = {"kafka_bootstrap": "127.0.0.1:9", "fetch_max_wait_ms": wait}
        endpoints.write_text(json.dumps(shown | ({"broker": broker} if broker else {})))
        running = settings_mod.load_running()
        assert running.kafka_idempotence is idempotent, broker  # no key: an older alma up
        # idle, an application beside alma up waits longer on either broker
        assert running.fetch_idle_wait_ms == settings_mod.EMBEDDED_FETCH_IDLE_WAIT_MS, broker
    monkeypatch.setenv("ALMA_KAFKA_IDEMPOTENCE", "true")
    assert settings_mod.load_running().kafka_idempotence is True


def test_checkpoint_concurrency_fits_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (2) shrinks to what a small pool allows (one connection to spare); a
    concurrency set explicitly that the pool cannot hold is refused, naming both."""
    assert load().checkpoint_transactions == 2
    monkeypatch.setenv("ALMA_PG_POOL_SIZE", "2")
    assert load().checkpoint_transactions == 1
    monkeypatch.setenv("ALMA_CHECKPOINT_CONCURRENCY", "2")
    with pytest.raises(errors.ConfigError, match=r"ALMA_CHECKPOINT_CONCURRENCY.*ALMA_PG_POOL_SIZE"):
        load()
    monkeypatch.setenv("ALMA_PG_POOL_SIZE", "5")
    assert load().checkpoint_transactions == 2
    monkeypatch.setenv("ALMA_CHECKPOINT_CONCURRENCY", "1")
    monkeypatch.setenv("ALMA_PG_POOL_SIZE", "1")
    assert load().checkpoint_transactions == 1


def test_the_consumer_groups_are_the_consumers_groups() -> None:
    """`alma offsets list` and the lag exporter list the groups the workers join."""
    from alma_core.consumers import checkpointer, joiner, learner

    groups = load(group_prefix="team").consumer_groups()
    assert set(groups) == {f"team-{c.GROUP}" for c in (checkpointer, joiner, learner)}
    assert groups["team-checkpointer"] == "alma.lifecycle.v1"


def test_a_group_instance_id_is_one_kafka_accepts() -> None:
    assert load(group_instance_id="w1.eu-west_2").group_instance_id == "w1.eu-west_2"
    assert load().group_instance_id is None  # no static membership unless asked
    for bad in ("", "two words", "x" * 250):
        with pytest.raises(errors.ConfigError, match="ALMA_GROUP_INSTANCE_ID"):
            load(group_instance_id=bad)
