"""``alma topics``: create ALMA's topics explicitly (never rely on auto-creation,
which gives 4 partitions on the embedded broker) and describe them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import typer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from rich.table import Table

from alma_core import errors, tenancy
from alma_core.cli import common
from alma_core.logs import redact
from alma_core.messaging import acls, kafka, topic_checks
from alma_core.messaging.topic_checks import TopicFacts
from alma_core.settings import Settings

topics_app = common.app(help="Kafka topics.")


def register(app: typer.Typer) -> None:
    app.add_typer(topics_app, name="topics")


def alma_topics(settings: Settings) -> list[str]:
    """The topics every deployment has (with ALMA_TENANT_TOPICS the lifecycle and reply
    topics are each tenant's: :func:`tenant_topics`)."""
    if settings.tenant_topics:
        return [settings.sequenced_topic, settings.dlq_topic]
    return [
        settings.lifecycle_topic,
        settings.sequenced_topic,
        settings.merged_topic,
        settings.dlq_topic,
    ]


def tenant_topics(settings: Settings, tenant: str) -> list[str]:
    """``tenant``'s lifecycle and reply topics (ALMA_TENANT_TOPICS); a tenant id that
    cannot name a topic is wrong usage."""
    problem = tenancy.topic_problem(settings.lifecycle_topic, tenant)
    if problem is None:
        problem = tenancy.topic_problem(settings.merged_topic, tenant)
    if problem:
        common.fail(problem, common.USAGE)
    names = settings.topic_names
    return [names.lifecycle_for(tenant), names.replies_for(tenant)]


LEADERS_S = 30.0  # how long newly created topics may take to have every partition led
DEFAULT_RECORD_BYTES: int = Settings.model_fields["max_record_bytes"].default


async def ensure_topics(
    bootstrap: str,
    names: list[str],
    *,
    partitions: int,
    replication_factor: int = 1,
    client_options: dict[str, Any] | None = None,
    max_record_bytes: int = DEFAULT_RECORD_BYTES,
) -> list[str]:
    """Create the topics that do not exist yet; returns the names created, once every
    partition of theirs has a leader (Apache Kafka answers CreateTopics before it has
    elected them, and a producer's first records would be refused and retried). Each
    takes records as large as ALMA accepts (``max.message.bytes``: Apache Kafka's default
    is 1 MB, under ALMA_MAX_RECORD_BYTES' 8 MB, and a record over it is refused at the
    producer, so a bad one could not even reach the dead letters)."""
    configs = topic_checks.creation_configs(max_record_bytes, replication_factor)
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=10_000, **(client_options or {})
    )
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        missing = [n for n in names if n not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # created meanwhile
                await admin.create_topics(
                    [
                        NewTopic(n, partitions, replication_factor, topic_configs=configs)
                        for n in missing
                    ]
                )
            await until_led(admin, bootstrap, missing)
        return missing
    except KafkaError as exc:
        raise common.kafka_unavailable(bootstrap, "create topics", exc) from exc
    finally:
        await admin.close()


async def until_led(
    admin: AIOKafkaAdminClient, bootstrap: str, names: list[str], limit_s: float = LEADERS_S
) -> None:
    """Wait until every partition of ``names`` has a leader (``limit_s`` at most)."""
    deadline = time.monotonic() + limit_s
    while True:
        described = await admin.describe_topics(names)
        waiting = sorted(
            d["topic"]
            for d in described
            if d["error_code"]
            or not d["partitions"]
            or any(p["error_code"] or p["leader"] < 0 for p in d["partitions"])
        )
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise errors.BrokerUnavailable(
                f"created {', '.join(waiting)} at {redact(bootstrap)}, but after {limit_s:.0f} "
                "s some of their partitions still have no leader. What to do: check the "
                "broker's log (a controller that cannot elect one, too few brokers for "
                "ALMA_REPLICATION_FACTOR), then run `alma topics create` again"
            )
        await asyncio.sleep(0.05)


async def describe_topics(
    bootstrap: str, names: list[str], client_options: dict[str, Any] | None = None
) -> dict[str, TopicFacts | None]:
    """What the broker says of each topic (its partitions, replication and
    configuration); None for one that does not exist."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=10_000, **(client_options or {})
    )
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        present = [n for n in names if n in existing]
        if not present:
            return dict.fromkeys(names)
        described = {d["topic"]: d for d in await admin.describe_topics(present)}
        configs = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n) for n in present]
        )
        by_topic = {
            r[3]: {e[0]: e[1] for e in r[4] if e[1] is not None}
            for response in configs
            for r in response.resources
        }
        facts: dict[str, TopicFacts | None] = dict.fromkeys(names)
        for name in present:
            partitions = described[name]["partitions"]
            replicas = min((len(p["replicas"]) for p in partitions), default=0)
            facts[name] = TopicFacts(name, len(partitions), replicas, by_topic.get(name, {}))
        return facts
    except KafkaError as exc:
        raise common.kafka_unavailable(bootstrap, "describe topics", exc) from exc
    finally:
        await admin.close()


@topics_app.command("create")
def topics_create(
    partitions: int = typer.Option(None, help="Partitions (ALMA_PARTITIONS)."),
    tenant: list[str] = typer.Option(
        None,
        "--tenant",
        help="With ALMA_TENANT_TOPICS: create this tenant's lifecycle and reply topics "
        "too; repeat for several.",
    ),
) -> None:
    """Create ALMA's topics where missing."""
    s = common.settings(partitions=partitions)
    if tenant and not s.tenant_topics:
        common.fail(
            "--tenant creates a tenant's own topics, which only ALMA_TENANT_TOPICS=true "
            "uses: set it (for the workers and the orchestrators alike), or leave --tenant out",
            common.USAGE,
        )
    per_tenant = [t for name in tenant or [] for t in tenant_topics(s, name)]

    async def main() -> None:
        created = await ensure_topics(
            common.bootstrap(s),
            alma_topics(s) + per_tenant,
            partitions=s.partitions,
            replication_factor=s.replication_factor,
            client_options=kafka.client_options(s),
            max_record_bytes=s.max_record_bytes,
        )
        common.out.print(f"created: {', '.join(created)}" if created else "all topics exist")

    common.run(main)


@topics_app.command("describe")
def topics_describe(as_json: bool = common.json_option("the topics")) -> None:
    """ALMA's topics as the broker has them (partitions, replication,
    min.insync.replicas, retention, largest record, compression), checked against what ALMA needs:
    exit 1 when one is missing or falls short, each problem saying what to do."""
    s = common.settings()

    async def main() -> None:
        names = alma_topics(s)
        facts = await describe_topics(common.bootstrap(s), names, kafka.client_options(s))
        missing = [n for n, f in facts.items() if f is None]
        found = {
            n: topic_checks.problems(f, s, lifecycle=n == s.lifecycle_topic)
            for n, f in facts.items()
            if f is not None
        }
        if as_json:
            docs = [
                {**f.to_doc(), "error": None, "problems": found[n]}
                if f is not None
                else {"name": n, "partitions": 0, "error": "does not exist", "problems": []}
                for n, f in facts.items()
            ]
            print(json.dumps(docs))
        else:
            table = Table(title="topics")
            columns = ("topic", "partitions", "replicas", "min in sync", "retention", "largest")
            for col in (*columns, "compression"):
                table.add_column(col)
            for n, f in facts.items():
                if f is None:
                    table.add_row(n, "does not exist", "", "", "", "", "")
                    continue
                doc = f.to_doc()
                table.add_row(
                    n,
                    str(f.partitions),
                    str(f.replication),
                    _shown(doc["min_insync_replicas"]),
                    _days(f.config_int("retention.ms")),
                    _shown(doc["max_message_bytes"]),
                    _shown(doc["compression_type"]),
                )
            common.out.print(table)
            for problem in (p for ps in found.values() for p in ps):
                common.err.print(f"- {problem}", markup=False)
        if missing:
            common.fail(f"missing: {', '.join(missing)}. What to do: run `alma topics create`")
        if any(found.values()):
            common.fail("some topics fall short of what ALMA needs (above)")

    common.run(main)


def _shown(value: object) -> str:
    return "" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _days(retention_ms: int | None) -> str:
    if retention_ms is None:
        return ""
    return "forever" if retention_ms < 0 else f"{retention_ms / 86_400_000:g} days"


@topics_app.command("acls")
def topics_acls(
    role: str = typer.Option(..., help="worker or orchestrator."),
    principal: str = typer.Option(
        None, help="The principal to grant (default: User:<ALMA_KAFKA_SASL_USERNAME>)."
    ),
    bootstrap: str = typer.Option("BROKER:9092", help="The --bootstrap-server to print."),
    tenant: str = typer.Option(
        None,
        "--tenant",
        help="With ALMA_TENANT_TOPICS: the tenant whose orchestrator this is (its own "
        "topics only); default ALMA_TENANT.",
    ),
) -> None:
    """Print the kafka-acls.sh lines that give a role the least it needs on an Apache
    Kafka with an authorizer (topics and groups from ALMA_* settings)."""
    s = common.settings()
    chosen = tenant or s.tenant
    if chosen is not None and s.tenant_topics:
        tenant_topics(s, chosen)  # a tenant id that can name no topic: wrong usage
    if role not in acls.ROLES:
        common.fail(f"--role {role!r}: expected one of {', '.join(acls.ROLES)}", common.USAGE)
    who = principal or acls.principal(s)
    if not who.startswith("User:"):
        who = "User:<name>"
    try:
        granted = acls.for_role(role, s, chosen if s.tenant_topics else None)
    except errors.ConfigError as exc:
        common.fail(exc.message, common.USAGE)
    for acl in granted:
        print(acl.command(who, bootstrap))
