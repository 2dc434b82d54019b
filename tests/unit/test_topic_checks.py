"""What ALMA needs of its topics, checked in pure code (alma_core.messaging.topic_checks):
replication, min.insync.replicas, the largest record, the lifecycle topic's retention."""

from __future__ import annotations

from alma_core.messaging.topic_checks import TopicFacts, creation_configs, problems
from alma_core.settings import Settings

DAY_MS = 86_400_000


def settings(**kw: object) -> Settings:
    return Settings(_env_file=None, **kw)  # type: ignore[call-arg]


def test_a_topic_as_alma_creates_it_has_no_problem() -> None:
    s = settings(replication_factor=3)
    made = creation_configs(s.max_record_bytes, 3)
    assert made["min.insync.replicas"] == "2"
    assert int(made["max.message.bytes"]) > s.max_record_bytes
    facts = TopicFacts("alma.lifecycle.v1", 12, 3, {**made, "retention.ms": str(7 * DAY_MS)})
    assert problems(facts, s, lifecycle=True) == []
    assert "min.insync.replicas" not in creation_configs(s.max_record_bytes, 1)


def test_each_shortfall_is_named_with_what_to_do() -> None:
    s = settings(replication_factor=3)
    facts = TopicFacts(
        "alma.lifecycle.v1",
        12,
        2,
        {"min.insync.replicas": "1", "max.message.bytes": "1048588", "retention.ms": "-1"},
    )
    found = problems(facts, s, lifecycle=True)
    assert len(found) == 4
    assert "2 replica(s), under ALMA_REPLICATION_FACTOR=3" in found[0]
    assert "min.insync.replicas=1" in found[1]
    assert "What to do: set min.insync.replicas to 2" in found[1]
    assert "refuses records over 1,048,588 bytes" in found[2]
    assert "keeps records forever" in found[3]
    # retention matters on the lifecycle topic only; one replica needs no in-sync floor
    other = TopicFacts("alma.merged.v1", 12, 1, {"min.insync.replicas": "1", "retention.ms": "-1"})
    assert problems(other, settings(), lifecycle=False) == []


def test_a_topic_codec_that_undoes_the_producers_is_named() -> None:
    """compression.type left to the producer (Kafka's default), or ALMA's own codec, is
    right; another codec, or uncompressed, makes every broker decompress each batch
    ALMA compressed (and compress it again, or store it whole)."""
    s = settings()
    assert s.kafka_compression == "zstd"

    def found(codec: str, **kw: object) -> list[str]:
        facts = TopicFacts("alma.merged.v1", 12, 1, {"compression.type": codec})
        return problems(facts, settings(**kw), lifecycle=False)

    assert found("producer") == found("zstd") == []
    gzip = found("gzip")
    assert len(gzip) == 1
    assert "compression.type=gzip, where ALMA's producers send zstd" in gzip[0]
    assert "compresses it again" in gzip[0]
    assert "--add-config compression.type=producer" in gzip[0]
    assert "ALMA_KAFKA_COMPRESSION=gzip" in gzip[0]
    stored_whole = found("uncompressed")
    assert "stores it whole" in stored_whole[0]
    assert "ALMA_KAFKA_COMPRESSION=none" in stored_whole[0]
    # records sent uncompressed: the broker's own codec is the operator's choice
    assert found("gzip", kafka_compression="none") == []
    assert found("lz4", kafka_compression="lz4") == []
