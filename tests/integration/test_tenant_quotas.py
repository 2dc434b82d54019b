"""Rate quotas per tenant (ALMA_TENANT_TOPICS): a tenant over its quota is delayed,
never dropped, and never holds another tenant back; each run's order is kept; a quota
set with `alma tenants set` takes effect without a restart. Invariants, not timings:
globex's events are all applied while acme's backlog is still waiting; afterwards every
acme event is applied once, in order, nothing dead-lettered."""

from __future__ import annotations

import json
import uuid

from aiokafka import AIOKafkaProducer

from alma_core.cli.topics import ensure_topics
from alma_core.consumers.lag import LagExporter
from alma_core.consumers.metrics import ExporterMetrics
from alma_core.settings import Settings
from alma_core.storage import postgres, tenant_settings
from tests.integration.conftest import TEST_PARTITIONS, Topics, settings_for
from tests.integration.harness import Worker, count, event, fetch, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of
from tests.services import Services

RUNS, STEPS = 4, 50  # acme: 200 events at 5 a second would take 40 s
GLOBEX_EVENTS = 20


async def test_a_tenant_over_its_quota_waits_alone_and_loses_nothing(
    services: Services, database: str
) -> None:
    suffix = uuid.uuid4().hex[:10]
    topics = Topics(f"lc-{suffix}", f"mg-{suffix}", f"dl-{suffix}", f"sq-{suffix}")
    settings = settings_for(
        services.kafka_bootstrap,
        database,
        services.redis_url,
        topics,
        tenant_topics=True,
        tenant_rate=5,  # the global quota: 5 events a second, 5 at once
        tenant_burst=5,
    )
    names = settings.topic_names
    per_tenant = [
        f(t) for t in ("acme", "globex") for f in (names.lifecycle_for, names.replies_for)
    ]
    await ensure_topics(
        services.kafka_bootstrap,
        [topics.dlq, topics.sequenced, *per_tenant],
        partitions=TEST_PARTITIONS,
    )
    async with postgres.connect(database, max_size=2) as pool:
        await tenant_settings.store(pool, "globex", rate_per_s=0, burst=None)  # no limit
        acme_runs = [f"acme-{suffix}-{r}" for r in range(RUNS)]
        async with Worker.start(settings) as worker:
            producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap)
            await producer.start()
            try:
                for step in range(STEPS):  # acme floods: 200 events at once
                    for run in acme_runs:
                        doc = event("node.completed", run, tenant="acme", updates={"i": step})
                        await producer.send(
                            names.lifecycle_for("acme"), json.dumps(doc).encode(), key=run.encode()
                        )
                await producer.flush()
                for i in range(GLOBEX_EVENTS):  # then globex sends a few, behind the flood
                    run = f"globex-{suffix}-{i % 2}"
                    doc = event("node.completed", run, tenant="globex", updates={"i": i})
                    await producer.send(
                        names.lifecycle_for("globex"), json.dumps(doc).encode(), key=run.encode()
                    )
                await producer.flush()
            finally:
                await producer.stop()

            async def applied(tenant: str) -> int:
                sql = "SELECT count(*) FROM checkpoints WHERE tenant_id = $1"
                return await count(database, sql, tenant)

            async def globex_done() -> bool:
                return await applied("globex") == GLOBEX_EVENTS

            await wait_for(globex_done, limit_s=30, what="globex's events, past acme's backlog")
            waiting = RUNS * STEPS - await applied("acme")
            assert waiting > 0, "acme's backlog was never held back"
            assert worker.value("alma_tenant_throttled_total", {"tenant": "acme"}) >= 1
            assert worker.value("alma_tenant_throttled_total", {"tenant": "globex"}) == 0
            assert worker.value("alma_tenant_events_total", {"tenant": "globex"}) == GLOBEX_EVENTS
            # the lag exporter follows the checkpointer over every tenant's topic: acme's
            # backlog is the lag of its own topic
            exporter = LagExporter(
                services.kafka_bootstrap,
                settings.consumer_groups(),
                ExporterMetrics(),
                patterns=settings.consumer_group_patterns(),
            )
            async with exporter:
                snapshot = await exporter.scrape()
            lag = snapshot.lag(f"{settings.group_prefix}-checkpointer")
            assert {topic for topic, _ in lag} == {
                names.lifecycle_for("acme"),
                names.lifecycle_for("globex"),
            }
            assert sum(n for (topic, _), n in lag.items() if topic.endswith(".acme")) > 0

            # lifted without a restart: the rest drains (at 5 a second it would take > 30 s)
            await tenant_settings.store(pool, "acme", rate_per_s=0, burst=None)

            async def acme_done() -> bool:
                return await applied("acme") == RUNS * STEPS

            await wait_for(acme_done, limit_s=25, what="acme's backlog, once its quota was lifted")
    rows = await fetch(
        database,
        """SELECT run_id, seq, state FROM checkpoints WHERE tenant_id = 'acme'
           ORDER BY run_id, seq""",
    )
    by_run: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append((r["seq"], r["state"]["i"]))
    for run in acme_runs:  # each once, in the order sent: seq n holds step n - 1
        assert by_run[run] == [(n + 1, n) for n in range(STEPS)], run
    assert await count(database, "SELECT count(*) FROM dead_letters") == 0


def test_alma_tenants_sets_shows_lists_and_resets(settings: Settings) -> None:
    env = env_of(settings) | {
        "ALMA_TENANT_TOPICS": "true",
        "ALMA_TENANT_RATE": "100",
        "ALMA_CHECKPOINT_RETENTION_DAYS": "30",
        "ALMA_TENANT_STORAGE_QUOTA_BYTES": "1000000",
    }
    # ids that can be no tenant (every shape of it: tests/unit/test_tenancy.py), numbers
    # that are no limit, and a name never seen here
    for args, why in (
        (("set", "", "--rate", "5", "--create"), "1 to 256 characters"),
        (("show", " "), "1 to 256 characters"),
        (("set", "bad tenant!", "--rate", "5", "--create"), "cannot name a Kafka topic"),
    ):
        refused = alma("tenants", *args, env=env)
        assert refused.returncode == 2, (args, refused.stdout)
        assert why in refused.stderr, refused.stderr
    infinite = alma("tenants", "set", "acme", "--rate", "inf", "--create", env=env)
    assert infinite.returncode == 2, infinite.stdout
    assert "--rate takes a finite number" in infinite.stderr
    typo = alma("tenants", "set", "acme", "--rate", "10", env=env)
    assert typo.returncode == 2
    assert "tenant 'acme' is unknown here" in typo.stderr
    assert "pass --create" in typo.stderr
    unknown = alma("tenants", "show", "acme", env=env)
    assert (unknown.returncode, unknown.stdout) == (1, "")
    assert "tenant 'acme' is unknown here" in unknown.stderr
    assert json.loads(alma("tenants", "list", "--json", env=env).stdout) == []  # none stored
    saved = alma("tenants", "set", "acme", "--rate", "10", "--burst", "20", "--create", env=env)
    assert saved.returncode == 0, saved.stderr
    assert "rate 10, burst 20" in saved.stdout
    burst_only = alma("tenants", "set", "acme", "--burst", "30", env=env)  # rate kept
    assert burst_only.returncode == 0, burst_only.stderr
    shown = json.loads(alma("tenants", "show", "acme", env=env).stdout)
    assert (shown["rate_per_s"], shown["burst"]) == (10, 30)
    assert shown["own"] == {
        "rate_per_s": 10,
        "burst": 30,
        "learner": None,
        "checkpoint_retention_days": None,
        "storage_quota_bytes": None,
        "max_state_bytes": None,
    }
    assert shown["learner"] is True  # the global default
    assert shown["storage_quota_bytes"] == 1_000_000  # ALMA_TENANT_STORAGE_QUOTA_BYTES
    assert shown["storage"] == {"used_bytes": 0, "quota_bytes": 1_000_000, "full": False}
    assert shown["checkpoint_retention_days"] == 30  # ALMA_CHECKPOINT_RETENTION_DAYS
    assert shown["usage"] == {  # nothing of acme's in this database yet
        "runs": 0,
        "open_runs": 0,
        "checkpoints": 0,
        "state_bytes": 0,
        "events": 0,
        "dead_letters": 0,
        "outcomes": 0,
        "memories": 0,
    }
    off = alma(  # the quota kept
        "tenants",
        "set",
        "acme",
        "--learner",
        "off",
        "--checkpoint-retention-days",
        "0",
        "--storage-quota-bytes",
        "0",
        "--max-state-bytes",
        "4096",
        env=env,
    )
    assert off.returncode == 0, off.stderr
    assert "learner off," in off.stdout
    assert "ALMA_TENANT_TOPICS" not in off.stderr  # no quota given: nothing to warn of
    shown = json.loads(alma("tenants", "show", "acme", env=env).stdout)
    assert shown["own"] == {
        "rate_per_s": 10,
        "burst": 30,
        "learner": False,
        "checkpoint_retention_days": 0,
        "storage_quota_bytes": 0,
        "max_state_bytes": 4096,
    }
    assert shown["max_state_bytes"] == 4096
    assert (shown["learner"], shown["checkpoint_retention_days"]) == (False, 0)
    assert shown["storage_quota_bytes"] is None  # 0: no limit, whatever the global one
    assert shown["storage"]["full"] is False
    table = alma("tenants", "list", env=env | {"COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    (acme,) = [line for line in table.stdout.splitlines() if "acme" in line]
    assert "off" in acme
    assert "forever" in acme
    assert "no limit" in acme  # its storage quota
    wrong = alma("tenants", "set", "acme", "--learner", "maybe", env=env)
    assert wrong.returncode == 2
    assert "--learner takes on, off or global (got 'maybe')" in wrong.stderr
    other = alma("tenants", "show", "globex", env=env)  # nothing of globex's here
    assert other.returncode == 1
    assert "the settings a new tenant gets are the global ones" in other.stderr
    listed = json.loads(alma("tenants", "list", "--json", env=env).stdout)
    assert [d["tenant_id"] for d in listed] == ["acme"]
    assert alma("tenants", "set", "acme", "--reset", env=env).returncode == 0
    # its own settings were all acme had here: back to the global ones, none stored
    assert json.loads(alma("tenants", "list", "--json", env=env).stdout) == []
    assert alma("tenants", "show", "acme", env=env).returncode == 1
    nothing = alma("tenants", "set", "acme", env=env)
    assert nothing.returncode == 2
    assert (
        "pass --rate, --burst, --learner, --checkpoint-retention-days, --storage-quota-bytes, "
        "--max-state-bytes or --reset" in nothing.stderr
    )
    above = alma("tenants", "set", "acme", "--max-state-bytes", "99999999", "--create", env=env)
    assert above.returncode == 0, above.stderr
    assert "ALMA_MAX_STATE_BYTES (" in above.stderr  # the ceiling: held to it, said so
    ceiling = json.loads(alma("tenants", "show", "acme", env=env).stdout)
    assert ceiling["max_state_bytes"] == ceiling_of(env)
    negative = alma("tenants", "set", "acme", "--rate", "-1", env=env)
    assert negative.returncode == 2
    without_topics = alma(
        "tenants",
        "set",
        "acme",
        "--rate",
        "5",
        env=env | {"ALMA_TENANT_RATE": "0", "ALMA_TENANT_TOPICS": "false"},
    )
    assert without_topics.returncode == 0, without_topics.stderr
    assert "only with ALMA_TENANT_TOPICS=true" in without_topics.stderr


def ceiling_of(env: dict[str, str]) -> int:
    """The global state size limit the command runs with."""
    return int(env.get("ALMA_MAX_STATE_BYTES") or Settings.model_fields["max_state_bytes"].default)
