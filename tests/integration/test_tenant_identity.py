"""A tenant is who produced the event (guarantee 9), on a real Apache Kafka with SASL
principals and its own authorizer: with ALMA_TENANT_TOPICS each tenant's orchestrator
(its own principal, granted exactly `alma topics acls --role orchestrator --tenant T`)
writes its own lifecycle topic and reads its own reply topic, and nothing else. Tenant
acme cannot write, read or replay anything of globex's: not by writing globex's topic
(the broker refuses), not by claiming globex in an event on its own topic (dead-lettered
as acme's, never applied), not by asking for a join's answer on globex's reply topic
(dead-lettered, nothing sent there), not by replaying such a letter (refused; forced, it
goes back to acme's own topic and is refused again)."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import TopicAuthorizationFailedError
from confluent_kafka.admin import NewTopic

from alma_core import errors
from alma_core.messaging import acls
from alma_core.sdk import dead_letters as letters
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from tests.integration.conftest import TEST_PARTITIONS, Topics
from tests.integration.harness import Worker, count, event, fetch, wait_for
from tests.integration.test_kafka_security import (
    Secured,
    _as_admin,
    grant,
    secured,  # noqa: F401 - the module's secured broker (a fixture)
)
from tests.services import Services

TENANTS = ("acme", "globex")


@dataclass(frozen=True)
class Tenanted:
    secured: Secured
    topics: Topics
    worker: Settings
    tenants: dict[str, Settings]  # each tenant's orchestrator

    def producer(self, user: str) -> AIOKafkaProducer:
        options = self.secured.security.client_options(user)
        return AIOKafkaProducer(bootstrap_servers=self.secured.broker.url, **options)

    def consumer(self, user: str) -> AIOKafkaConsumer:
        options = self.secured.security.client_options(user)
        return AIOKafkaConsumer(bootstrap_servers=self.secured.broker.url, **options)


@pytest.fixture
async def tenanted(
    secured: Secured,  # noqa: F811 - the fixture imported above
    services: Services,
    database: str,
) -> Tenanted:
    """Fresh topics (the shared internal ones and each tenant's two, created by the admin),
    the workers' principal and each tenant's granted what `alma topics acls` prints."""
    suffix = uuid.uuid4().hex[:10]
    topics = Topics(f"lc-{suffix}", f"mg-{suffix}", f"dl-{suffix}", f"sq-{suffix}")
    worker = secured.settings("worker", services, database, topics).model_copy(
        update={"tenant_topics": True}
    )
    names = [topics.dlq, topics.sequenced] + [
        topic
        for tenant in TENANTS
        for topic in (
            worker.topic_names.lifecycle_for(tenant),
            worker.topic_names.replies_for(tenant),
        )
    ]
    await asyncio.to_thread(
        _as_admin,
        secured,
        lambda a: a.create_topics([NewTopic(t, TEST_PARTITIONS, 1) for t in names]),
    )
    await grant(secured, "worker", acls.for_role("worker", worker))
    tenants = {}
    for tenant in TENANTS:
        own = secured.settings(tenant, services, database, topics).model_copy(
            update={"tenant_topics": True, "group_prefix": worker.group_prefix}
        )
        await grant(secured, tenant, acls.for_role("orchestrator", own, tenant))
        tenants[tenant] = own
    return Tenanted(secured, topics, worker, tenants)


def _ctx(tenant: str, run: str, branch: str | None = None) -> WorkflowContext:
    return WorkflowContext(
        tenant_id=tenant, workflow_id="wf", run_id=run, node_id=f"n-{branch}", branch_id=branch
    )


@pytest.mark.slow
async def test_each_tenant_runs_its_joins_on_its_own_topics_and_can_touch_no_others(
    tenanted: Tenanted,
) -> None:
    t = tenanted
    run = f"same-{uuid.uuid4().hex[:6]}"  # both tenants use the same run id
    async with (
        Worker.start(t.worker, ("checkpointer", "joiner")),
        AlmaClient(t.tenants["acme"]) as acme,
        AlmaClient(t.tenants["globex"]) as globex,
    ):

        async def join(client: AlmaClient, tenant: str, scale: int) -> object:
            for branch, value in (("b0", 1), ("b1", 2)):
                await client.node_completed(
                    _ctx(tenant, run, branch), updates={"n": value * scale}, wait="applied"
                )
            return await client.merge(
                _ctx(tenant, run), branch_ids=["b0", "b1"], reducers={"n": "sum"}, timeout=60
            )

        merged = await asyncio.gather(join(acme, "acme", 1), join(globex, "globex", 10))
    assert [m.merged_state for m in merged] == [{"n": 3}, {"n": 30}]  # type: ignore[attr-defined]

    names = t.worker.topic_names
    producer = t.producer("acme")
    await producer.start()
    try:  # write globex's events, forge a reply on its own reply topic or globex's
        for topic in (
            names.lifecycle_for("globex"),
            names.replies_for("acme"),
            names.replies_for("globex"),
            t.topics.sequenced,
            t.topics.dlq,
        ):
            with pytest.raises(TopicAuthorizationFailedError):
                await producer.send_and_wait(topic, b"{}", key=run.encode())
    finally:
        await producer.stop()
    for topic in (  # read globex's replies, or anyone's events (its own included)
        names.replies_for("globex"),
        names.lifecycle_for("globex"),
        names.lifecycle_for("acme"),
    ):
        assert await _end_offsets(t, topic) > 0, f"{topic} holds records to be kept from acme"
        assert await _reads_nothing(t, "acme", topic), topic


async def _reads_nothing(t: Tenanted, user: str, topic: str) -> bool:
    """True when ``user`` gets no record of ``topic`` from its start in ~5 s: the broker
    refuses its fetches (no READ) or tells it nothing of the topic (no DESCRIBE, which
    aiokafka logs and waits on)."""
    consumer = t.consumer(user)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(TEST_PARTITIONS)])
        for _ in range(10):
            try:
                batch = await consumer.getmany(timeout_ms=500)
            except TopicAuthorizationFailedError:
                return True
            if any(batch.values()):
                return False
        return True
    finally:
        await consumer.stop()


async def _end_offsets(t: Tenanted, topic: str) -> int:
    """How many records ``topic`` has ever held (read as the broker's own user)."""
    consumer = t.consumer("admin")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(TEST_PARTITIONS)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


@pytest.mark.slow
async def test_an_event_claiming_another_tenant_is_dead_lettered_as_its_producers(
    tenanted: Tenanted, database: str
) -> None:
    t = tenanted
    names = t.worker.topic_names
    run = f"victim-{uuid.uuid4().hex[:6]}"
    forged = event("node.completed", run, tenant="globex", updates={"owned": True})
    elsewhere = event(
        "branch.join",
        run,
        tenant="acme",
        join_id="j-elsewhere",
        branch_ids=["b0", "b1"],
        reply_to=names.replies_for("globex"),
    )
    honest = event("node.completed", run, tenant="acme", updates={"n": 1})
    async with Worker.start(t.worker, ("checkpointer", "joiner")) as worker:
        producer = t.producer("acme")  # acme's own principal, on its own topic
        await producer.start()
        try:
            for doc in (forged, elsewhere, honest):
                await producer.send_and_wait(
                    names.lifecycle_for("acme"), json.dumps(doc).encode(), key=run.encode()
                )
        finally:
            await producer.stop()

        async def honest_applied() -> int:
            sql = "SELECT count(*) FROM checkpoints WHERE tenant_id = 'acme' AND run_id = $1"
            return await count(database, sql, run)

        await wait_for(honest_applied, what="acme's own event, after the two refused")
        refused = {
            "tenant_not_producer": worker.value(
                "alma_tenant_refused_total", {"tenant": "acme", "reason": "tenant_not_producer"}
            ),
            "reply_to_refused": worker.value(
                "alma_tenant_refused_total", {"tenant": "acme", "reason": "reply_to_refused"}
            ),
        }
    assert refused == {"tenant_not_producer": 1.0, "reply_to_refused": 1.0}
    rows = await fetch(
        database,
        "SELECT id, reason, tenant_id, event_id, source_topic FROM dead_letters ORDER BY id",
    )
    assert [(r["reason"], r["tenant_id"], r["event_id"]) for r in rows] == [
        ("tenant_not_producer", "acme", forged["event_id"]),
        ("reply_to_refused", "acme", elsewhere["event_id"]),
    ]
    assert {r["source_topic"] for r in rows} == {names.lifecycle_for("acme")}
    sql = "SELECT count(*) FROM {} WHERE tenant_id = 'globex'"
    for table in ("runs", "checkpoints", "run_events"):
        assert await count(database, sql.format(table)) == 0, table
    assert await _end_offsets(t, names.replies_for("globex")) == 0

    # The letter is acme's: globex is told there is none; acme's replay is refused (it
    # would be refused again), and forced it goes back to acme's topic, refused again
    letter = rows[0]["id"]
    async with AlmaClient(t.tenants["acme"]) as acme:
        conn = await asyncpg.connect(database)
        try:

            async def replay(tenant: str, *, force: bool = False) -> None:
                await letters.replay(
                    conn,
                    acme.publish_record,
                    letter,
                    tenant_id=tenant,
                    topics=t.tenants[tenant].topic_names,
                    max_state_bytes=t.worker.max_state_bytes,
                    force=force,
                )

            with pytest.raises(errors.AlmaError, match="no dead letter"):
                await replay("globex")
            with pytest.raises(errors.AlmaError, match="tenant_not_producer"):
                await replay("acme")
            await replay("acme", force=True)
        finally:
            await conn.close()
    async with Worker.start(t.worker, ("checkpointer",)):

        async def refused_again() -> int:
            sql = "SELECT count(*) FROM dead_letters WHERE reason = 'tenant_not_producer'"
            return await count(database, sql) == 2

        await wait_for(refused_again, what="the forced replay refused again")
    for table in ("runs", "checkpoints", "run_events"):
        assert await count(database, sql.format(table)) == 0, table


async def test_a_tenant_principal_that_may_write_nothing_is_told_which_topic(
    tenanted: Tenanted, services: Services, database: str
) -> None:
    """A principal granted nothing: its client does not start (Kafka refuses an idempotent
    producer's id to a principal that may write no topic), and the error names the
    tenant topic it needs, not the shared one."""
    nobody = tenanted.secured.settings(
        "orch-reads-only", services, database, tenanted.topics
    ).model_copy(update={"tenant_topics": True})
    with pytest.raises(errors.BrokerDenied) as refused:
        async with AlmaClient(nobody) as client:
            await client.node_completed(_ctx("acme", "denied", "b0"), updates={"n": 1})
    assert f"WRITE on topic '{tenanted.topics.lifecycle}.<tenant>'" in refused.value.message
