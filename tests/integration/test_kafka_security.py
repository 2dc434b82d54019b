"""SASL/SCRAM-SHA-512 over TLS, and Kafka's own authorizer, on a real Apache Kafka: the
workers' principal and an orchestrator's, each granted exactly what
``alma topics acls`` says its role needs (alma_core/messaging/acls.py), run a join end
to end; the orchestrator can do nothing else (read the lifecycle topic, write replies
or dead letters, join the workers' groups); and a refusal is an error that names the
ACL that is missing and the line that grants it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaError,
    TopicAuthorizationFailedError,
)
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)

from alma_core import errors
from alma_core.cli import embedded_secure
from alma_core.cli.embedded_kafka import KafkaBroker, Security, default_libs
from alma_core.messaging import acls
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from tests.integration.conftest import Topics, settings_for
from tests.integration.harness import Worker
from tests.services import Services

USERS = {
    "admin": "admin-s3cret",
    "worker": "worker-s3cret",
    "orch": "orch-s3cret",
    "orch-reads-only": "reader-s3cret",
    # one orchestrator principal per tenant (test_tenant_identity.py)
    "acme": "acme-s3cret",
    "globex": "globex-s3cret",
}


@dataclass(frozen=True)
class Secured:
    broker: KafkaBroker
    security: Security

    def admin(self) -> AdminClient:
        return AdminClient(
            {
                "bootstrap.servers": self.broker.url,
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": "admin",
                "sasl.password": USERS["admin"],
                "ssl.ca.location": str(self.security.ca),
            }
        )

    def settings(self, user: str, services: Services, database: str, topics: Topics) -> Settings:
        return settings_for(
            self.broker.url,
            database,
            services.redis_url,
            topics,
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="SCRAM-SHA-512",
            kafka_sasl_username=user,
            kafka_sasl_password=USERS[user],
            kafka_ssl_cafile=self.security.ca,
        )


@pytest.fixture(scope="module")
async def secured(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Secured]:
    folder = tmp_path_factory.mktemp("secured-kafka")
    embedded_secure.make_pki(folder)  # the CA and broker certificate `alma up --secure` makes
    security = Security(USERS, folder / "broker.pem", folder / "broker.key", folder / "ca.pem")
    broker = KafkaBroker(folder / "kafka", folder / "run", libs=default_libs(), security=security)
    await broker.start()
    try:
        yield Secured(broker, security)
    finally:
        await broker.stop()


def _as_admin(secured: Secured, ask: Callable[[AdminClient], dict[Any, Any]]) -> None:
    """Ask the admin API (confluent-kafka's: aiokafka has no ACL calls) and wait for every
    answer, the client held until then."""
    admin = secured.admin()
    for future in ask(admin).values():
        future.result(30)


async def refusal(consumer: AIOKafkaConsumer) -> KafkaError:
    """What the broker answers a consumer's fetches with, within ~10 s."""
    for _ in range(20):
        try:
            await consumer.getmany(timeout_ms=500)
        except KafkaError as exc:
            return exc
    raise AssertionError("the broker never refused the consumer")


async def _topics(secured: Secured) -> Topics:
    """Fresh topics, created by the admin (neither role may create topics)."""
    topics = Topics.fresh()
    await asyncio.to_thread(
        _as_admin, secured, lambda a: a.create_topics([NewTopic(t, 4, 1) for t in topics.all])
    )
    return topics


async def grant(secured: Secured, user: str, granted: list[acls.Acl]) -> None:
    """Create ``granted`` for ``user`` with Kafka's own admin API (as the admin)."""
    bindings = [
        AclBinding(
            ResourceType.TOPIC if acl.kind == "topic" else ResourceType.GROUP,
            acl.name,
            ResourcePatternType.PREFIXED if acl.prefixed else ResourcePatternType.LITERAL,
            f"User:{user}",
            "*",
            getattr(AclOperation, acl.operation),
            AclPermissionType.ALLOW,
        )
        for acl in granted
    ]
    await asyncio.to_thread(_as_admin, secured, lambda a: a.create_acls(bindings))
    # The controller has them; the broker's authorizer applies them a moment later (its
    # DescribeAcls answers from that authorizer): wait until it lists them all
    wanted = {(b.name, b.operation) for b in bindings}
    everyone = AclBindingFilter(
        ResourceType.ANY,
        None,
        ResourcePatternType.ANY,
        f"User:{user}",
        None,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )

    def listed() -> set[tuple[str, Any]]:
        admin = secured.admin()  # held until the answer comes
        found = admin.describe_acls(everyone).result(30)
        return {(b.name, b.operation) for b in found}

    deadline = time.monotonic() + 15
    while not wanted <= await asyncio.to_thread(listed):
        assert time.monotonic() < deadline, "the broker never listed the ACLs granted"
        await asyncio.sleep(0.1)


def _ctx(run: str, branch: str | None = None, node: str = "n") -> WorkflowContext:
    return WorkflowContext(
        tenant_id="acme", workflow_id="wf", run_id=run, node_id=node, branch_id=branch
    )


@pytest.mark.slow
async def test_each_role_with_only_its_acls_runs_a_join_end_to_end(
    secured: Secured, services: Services, database: str
) -> None:
    topics = await _topics(secured)
    worker = secured.settings("worker", services, database, topics)
    orch = secured.settings("orch", services, database, topics)
    orch = orch.model_copy(update={"group_prefix": worker.group_prefix})
    await grant(secured, "worker", acls.for_role("worker", worker))
    await grant(secured, "orch", acls.for_role("orchestrator", orch))
    run = f"secured-{uuid.uuid4().hex[:6]}"
    async with Worker.start(worker, ("checkpointer", "joiner")), AlmaClient(orch) as client:
        for branch, value in (("b0", 1), ("b1", 2)):
            await client.node_completed(
                _ctx(run, branch, f"n-{branch}"), updates={"n": value}, wait="applied"
            )
        merged = await client.merge(
            _ctx(run), branch_ids=["b0", "b1"], reducers={"n": "sum"}, timeout=60
        )
    assert merged.merged_state == {"n": 3}
    assert merged.checkpoint_seq is not None


async def test_an_orchestrator_can_do_nothing_but_its_role(
    secured: Secured, services: Services, database: str
) -> None:
    topics = await _topics(secured)
    orch = secured.settings("orch", services, database, topics)
    await grant(secured, "orch", acls.for_role("orchestrator", orch))
    options = secured.security.client_options("orch")
    consumer = AIOKafkaConsumer(bootstrap_servers=secured.broker.url, **options)
    await consumer.start()
    try:  # read the lifecycle topic (everyone's events)
        consumer.assign([TopicPartition(topics.lifecycle, 0)])
        assert isinstance(await refusal(consumer), TopicAuthorizationFailedError)
    finally:
        await consumer.stop()
    producer = AIOKafkaProducer(bootstrap_servers=secured.broker.url, **options)
    await producer.start()
    try:  # forge a reply, a dead letter, a sequenced hand-off
        for topic in (topics.merged, topics.dlq, topics.sequenced):
            with pytest.raises(TopicAuthorizationFailedError):
                await producer.send_and_wait(topic, b"{}", key=b"r")
    finally:
        await producer.stop()
    member = AIOKafkaConsumer(
        topics.merged,
        bootstrap_servers=secured.broker.url,
        group_id=f"{orch.group_prefix}-checkpointer",  # join the workers' group
        **options,
    )
    try:
        with pytest.raises(GroupAuthorizationFailedError):
            await member.start()
    finally:
        await member.stop()


async def test_a_refusal_names_the_acl_that_is_missing(
    secured: Secured, services: Services, database: str
) -> None:
    """An orchestrator that may read its replies but not write events: its client does
    not start (Kafka refuses an idempotent producer's id to a principal that may write
    no topic), with an error that names WRITE on the lifecycle topic, the principal, and
    the grant, not "cannot reach Kafka"."""
    topics = await _topics(secured)
    reader = secured.settings("orch-reads-only", services, database, topics)
    await grant(
        secured,
        "orch-reads-only",
        [a for a in acls.for_role("orchestrator", reader) if a.operation != "WRITE"],
    )
    with pytest.raises(errors.BrokerDenied) as refused:  # at start: its producer's id
        async with AlmaClient(reader) as client:
            await client.node_completed(_ctx("denied"), updates={"n": 1})
    message = refused.value.message
    assert f"Kafka refused WRITE on topic {topics.lifecycle!r} to User:orch-reads-only" in message
    assert (
        "--add --allow-principal User:orch-reads-only --operation Write "
        f"--topic {topics.lifecycle}" in message
    )


async def test_a_worker_refused_its_group_stops_saying_which_acl(
    secured: Secured, services: Services, database: str
) -> None:
    """A worker's principal without READ on its consumer groups: the worker does not
    retry a refusal as if the broker were down; it stops, naming the group ACL."""
    topics = await _topics(secured)
    worker = secured.settings("worker", services, database, topics)
    await grant(
        secured, "worker", [a for a in acls.for_role("worker", worker) if a.kind != "group"]
    )
    with pytest.raises(errors.BrokerDenied) as refused:
        async with Worker.start(worker):
            pass
    message = refused.value.message
    assert f"Kafka refused READ on group '{worker.group_prefix}-checkpointer'" in message
    assert "to User:worker (GroupAuthorizationFailedError)" in message


async def test_an_orchestrator_that_may_not_read_its_replies_is_told_so(
    secured: Secured, services: Services, database: str
) -> None:
    """It may publish, but not read the reply topic: a merge fails at once with the READ
    it lacks, not after its timeout as if no reply came."""
    topics = await _topics(secured)
    writer = secured.settings("orch-reads-only", services, database, topics)
    granted = [a for a in acls.for_role("orchestrator", writer) if a.operation != "READ"]
    await grant(secured, "orch-reads-only", granted)
    async with AlmaClient(writer) as client:
        with pytest.raises(errors.BrokerDenied) as refused:
            await client.merge(_ctx("no-replies"), branch_ids=["a", "b"], timeout=60)
    assert f"Kafka refused READ on topic {topics.merged!r}" in refused.value.message


def test_the_acls_printed_are_the_ones_granted(tmp_path: Path) -> None:
    """`alma topics acls` prints, for each role, one kafka-acls.sh line per ACL of
    acls.for_role: what the tests above grant is what an operator is told to run."""
    from tests.integration.test_cli import alma

    for role in acls.ROLES:
        shown = alma("topics", "acls", "--role", role, "--principal", "User:someone")
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert len(lines) == len(acls.for_role(role, Settings()))
        assert all("--allow-principal User:someone" in line for line in lines)
