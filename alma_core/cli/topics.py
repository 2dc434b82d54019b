"""``alma topics``: create ALMA's topics explicitly (never rely on auto-creation,
which gives 4 partitions on the embedded broker) and describe them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import typer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from rich.table import Table

from alma_core import errors
from alma_core.cli import common
from alma_core.logs import redact
from alma_core.messaging import acls, kafka
from alma_core.settings import Settings

topics_app = common.app(help="Kafka topics.")


def register(app: typer.Typer) -> None:
    app.add_typer(topics_app, name="topics")


@dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    error: str | None = None


def alma_topics(settings: Settings) -> list[str]:
    return [
        settings.lifecycle_topic,
        settings.sequenced_topic,
        settings.merged_topic,
        settings.dlq_topic,
    ]


# What a record may carry beside its value (key, headers, batch framing): ALMA's
# producers ask for ALMA_MAX_RECORD_BYTES plus this (their max_request_size).
RECORD_OVERHEAD = 64 * 1024
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
    configs = {"max.message.bytes": str(max_record_bytes + RECORD_OVERHEAD)}
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
            await _until_led(admin, bootstrap, missing)
        return missing
    except KafkaError as exc:
        raise common.kafka_unavailable(bootstrap, "create topics", exc) from exc
    finally:
        await admin.close()


async def _until_led(
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
) -> list[TopicInfo]:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=10_000, **(client_options or {})
    )
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        present = [n for n in names if n in existing]
        described = await admin.describe_topics(present) if present else []
        by_name = {d["topic"]: len(d["partitions"]) for d in described}
        return [
            TopicInfo(n, by_name.get(n, 0), None if n in existing else "does not exist")
            for n in names
        ]
    except KafkaError as exc:
        raise common.kafka_unavailable(bootstrap, "describe topics", exc) from exc
    finally:
        await admin.close()


@topics_app.command("create")
def topics_create(
    partitions: int = typer.Option(None, help="Partitions (ALMA_PARTITIONS)."),
) -> None:
    """Create ALMA's topics where missing."""
    s = common.settings(partitions=partitions)

    async def main() -> None:
        created = await ensure_topics(
            common.bootstrap(s),
            alma_topics(s),
            partitions=s.partitions,
            replication_factor=s.replication_factor,
            client_options=kafka.client_options(s),
            max_record_bytes=s.max_record_bytes,
        )
        common.out.print(f"created: {', '.join(created)}" if created else "all topics exist")

    common.run(main)


@topics_app.command("describe")
def topics_describe(as_json: bool = common.json_option("the topics")) -> None:
    """Partition counts of ALMA's topics."""
    s = common.settings()

    async def main() -> None:
        infos = await describe_topics(common.bootstrap(s), alma_topics(s), kafka.client_options(s))
        if as_json:
            print(json.dumps([i.__dict__ for i in infos]))
        else:
            table = Table(title="topics")
            for col in ("topic", "partitions", "note"):
                table.add_column(col)
            for i in infos:
                table.add_row(i.name, str(i.partitions), i.error or "")
            common.out.print(table)
        if any(i.error for i in infos):
            common.fail("some topics are missing: run `alma topics create`")

    common.run(main)


@topics_app.command("acls")
def topics_acls(
    role: str = typer.Option(..., help="worker or orchestrator."),
    principal: str = typer.Option(
        None, help="The principal to grant (default: User:<ALMA_KAFKA_SASL_USERNAME>)."
    ),
    bootstrap: str = typer.Option("BROKER:9092", help="The --bootstrap-server to print."),
) -> None:
    """Print the kafka-acls.sh lines that give a role the least it needs on an Apache
    Kafka with an authorizer (topics and groups from ALMA_* settings)."""
    s = common.settings()
    if role not in acls.ROLES:
        common.fail(f"--role {role!r}: expected one of {', '.join(acls.ROLES)}", common.USAGE)
    who = principal or acls.principal(s)
    if not who.startswith("User:"):
        who = "User:<name>"
    for acl in acls.for_role(role, s):
        print(acl.command(who, bootstrap))
