"""Kafka topics: create ALMA's topics explicitly (never rely on auto-creation,
which gives 4 partitions on the embedded broker) and describe them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from alma_core import errors
from alma_core.settings import Settings


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


async def ensure_topics(
    bootstrap: str,
    names: list[str],
    *,
    partitions: int,
    replication_factor: int = 1,
) -> list[str]:
    """Create the topics that do not exist yet; returns the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        missing = [n for n in names if n not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # created meanwhile
                await admin.create_topics(
                    [NewTopic(n, partitions, replication_factor) for n in missing]
                )
        return missing
    except KafkaError as exc:
        raise errors.ConfigError(
            f"cannot create topics on {bootstrap}: {exc!r}; check ALMA_KAFKA_BOOTSTRAP"
        ) from exc
    finally:
        await admin.close()


async def describe_topics(bootstrap: str, names: list[str]) -> list[TopicInfo]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
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
        raise errors.ConfigError(
            f"cannot reach Kafka at {bootstrap}: {exc!r}; check ALMA_KAFKA_BOOTSTRAP"
        ) from exc
    finally:
        await admin.close()
