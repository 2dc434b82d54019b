"""The least each role needs on an Apache Kafka with an authorizer (pure): which topics
and groups, and the kafka-acls.sh line a refusal names."""

from __future__ import annotations

from aiokafka.errors import TopicAuthorizationFailedError

from alma_core.messaging import acls
from alma_core.settings import Settings


def test_an_orchestrator_writes_events_and_reads_replies_and_nothing_else() -> None:
    s = Settings(lifecycle_topic="lc", merged_topic="mg", dlq_topic="dl", sequenced_topic="sq")
    granted = {(a.operation, a.kind, a.name) for a in acls.for_role("orchestrator", s)}
    assert granted == {
        ("WRITE", "topic", "lc"),
        ("DESCRIBE", "topic", "lc"),
        ("READ", "topic", "mg"),
        ("DESCRIBE", "topic", "mg"),
    }


def test_a_worker_reads_events_writes_what_it_produces_and_owns_its_groups() -> None:
    s = Settings(
        lifecycle_topic="lc",
        merged_topic="mg",
        dlq_topic="dl",
        sequenced_topic="sq",
        group_prefix="team",
    )
    granted = {(a.operation, a.kind, a.name, a.prefixed) for a in acls.for_role("worker", s)}
    assert ("READ", "topic", "lc", False) in granted
    assert ("WRITE", "topic", "lc", False) not in granted  # it never writes events
    assert {("WRITE", "topic", t, False) for t in ("sq", "mg", "dl")} <= granted
    assert ("READ", "topic", "dl", False) not in granted
    assert ("READ", "group", "team-", True) in granted
    assert all(a.kind != "cluster" for a in acls.for_role("worker", s))


def test_a_refusal_names_the_operation_the_principal_and_the_grant() -> None:
    s = Settings(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="orch",
        kafka_sasl_password="secret",
    )
    acl = acls.Acl("READ", "group", "alma-", prefixed=True)
    refused = acls.denied(acls.principal(s), acl, TopicAuthorizationFailedError())
    assert refused.message.startswith(
        "Kafka refused READ on group 'alma-' to User:orch (TopicAuthorizationFailedError)"
    )
    assert (
        "kafka-acls.sh --bootstrap-server BROKER:9092 --add --allow-principal User:orch "
        "--operation Read --group alma- --resource-pattern-type prefixed" in refused.message
    )
    assert acls.principal(Settings()) == "this client"
    assert "User:<name>" in acls.denied("this client", acl, TopicAuthorizationFailedError()).message
    assert (
        acls.Acl("DESCRIBE_CONFIGS", "topic", "t")
        .command("User:w")
        .endswith("--operation DescribeConfigs --topic t")
    )
