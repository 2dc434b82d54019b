"""What ALMA needs of its topics, checked against what the broker says of them, in pure
code: `alma topics describe` lists every problem (and exits 1), a worker warns of those
it can read at start.

* **Replication**: at least ``ALMA_REPLICATION_FACTOR``; with more than one replica,
  ``min.insync.replicas`` of 2 at least, or a record acknowledged with ``acks=all`` may
  live on one broker only (ALMA's producers wait for every in-sync replica).
* **Record size**: ``max.message.bytes`` of at least ``ALMA_MAX_RECORD_BYTES`` (Apache
  Kafka's default is 1 MB): a larger event would be refused at its producer and never
  reach the dead letters.
* **Retention of the lifecycle topic**: shorter than run rows live
  (``ALMA_RUN_RETENTION_DAYS``), or a record replayed after its run was pruned would
  start that run again (:meth:`~alma_core.settings.RetentionPolicy.replay_problem`).
* **Compression**: ``compression.type`` left to the producer (``producer``, Kafka's
  default) or ALMA_KAFKA_COMPRESSION's own codec: any other makes every broker
  decompress and compress again each batch ALMA's producers send (``uncompressed``
  stores them whole, about four times the size of agents' JSON states in zstd).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from alma_core.settings import Settings

# What a record may carry beside its value (key, headers, batch framing): ALMA's
# producers ask for ALMA_MAX_RECORD_BYTES plus this, and its topics take as much.
RECORD_OVERHEAD = 64 * 1024


@dataclass(frozen=True)
class TopicFacts:
    """What the broker says of one topic: its partitions, its replication factor (the
    fewest replicas any partition has) and its configuration (``retention.ms``,
    ``min.insync.replicas``, ``max.message.bytes``, ...)."""

    name: str
    partitions: int
    replication: int
    configs: Mapping[str, str] = field(default_factory=dict)

    def config_int(self, key: str) -> int | None:
        value = self.configs.get(key)
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None

    def to_doc(self) -> dict[str, object]:
        return {
            "name": self.name,
            "partitions": self.partitions,
            "replication_factor": self.replication,
            "min_insync_replicas": self.config_int("min.insync.replicas"),
            "retention_ms": self.config_int("retention.ms"),
            "max_message_bytes": self.config_int("max.message.bytes"),
            "compression_type": self.configs.get("compression.type"),
        }


def compression_problem(facts: TopicFacts, settings: Settings) -> str | None:
    """The topic's own codec, where it undoes the one ALMA's producers compress with
    (a broker's own codec for records ALMA sends uncompressed is the operator's choice)."""
    codec = facts.configs.get("compression.type")
    ours = settings.kafka_compression
    if codec is None or codec in ("producer", ours) or ours == "none":
        return None
    if codec == "uncompressed":
        effect, instead = "decompresses each batch and stores it whole", "none"
    else:
        effect, instead = "decompresses each batch and compresses it again", codec
    return (
        f"the topic {facts.name} has compression.type={codec}, where ALMA's producers send "
        f"{ours}: every broker {effect}. What to do: set the topic's compression.type to "
        "producer (kafka-configs.sh --alter --entity-type topics ... --add-config "
        f"compression.type=producer), or ALMA_KAFKA_COMPRESSION={instead}"
    )


def record_limit_problem(facts: TopicFacts, settings: Settings) -> str | None:
    largest = facts.config_int("max.message.bytes")
    if largest is None or largest >= settings.max_record_bytes:
        return None
    return (
        f"the topic {facts.name} refuses records over {largest:,} bytes (max.message.bytes), "
        f"under ALMA_MAX_RECORD_BYTES={settings.max_record_bytes:,}: a larger event is "
        "refused at its producer and never reaches the dead letters. What to do: raise "
        f"the topic's max.message.bytes to {settings.max_record_bytes + RECORD_OVERHEAD} "
        "(kafka-configs.sh --alter --entity-type topics ...), or lower "
        "ALMA_MAX_RECORD_BYTES to what the topic takes"
    )


def problems(facts: TopicFacts, settings: Settings, *, lifecycle: bool) -> list[str]:
    """Every way ``facts`` falls short of what ALMA needs (``lifecycle``: the topic is
    the lifecycle topic, whose retention matters), each saying what to do."""
    found = []
    if facts.replication < settings.replication_factor:
        found.append(
            f"the topic {facts.name} has {facts.replication} replica(s), under "
            f"ALMA_REPLICATION_FACTOR={settings.replication_factor}. What to do: add replicas "
            "(kafka-reassign-partitions.sh), or set ALMA_REPLICATION_FACTOR to what the "
            "cluster has"
        )
    in_sync = facts.config_int("min.insync.replicas")
    if facts.replication > 1 and in_sync is not None and in_sync < 2:
        found.append(
            f"the topic {facts.name} has {facts.replication} replicas but "
            f"min.insync.replicas={in_sync}: a record acknowledged to ALMA's producers "
            "(acks=all) may live on one broker only. What to do: set min.insync.replicas "
            "to 2 (kafka-configs.sh --alter --entity-type topics ...)"
        )
    for problem in (record_limit_problem(facts, settings), compression_problem(facts, settings)):
        if problem:
            found.append(problem)
    retention = facts.config_int("retention.ms")
    if lifecycle and retention is not None:
        replay = settings.retention.replay_problem(facts.name, retention)
        if replay:
            found.append(replay)
    return found


def creation_configs(max_record_bytes: int, replication_factor: int) -> dict[str, str]:
    """The configuration ALMA gives a topic it creates: records as large as it
    accepts, and, replicated, an acknowledged record on two brokers at least."""
    configs = {"max.message.bytes": str(max_record_bytes + RECORD_OVERHEAD)}
    if replication_factor > 1:
        configs["min.insync.replicas"] = "2"
    return configs
