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
import shlex
import sys
import uuid
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import TopicAuthorizationFailedError
from confluent_kafka.admin import NewTopic
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from redis import exceptions as redis_errors

from alma_core import errors
from alma_core.messaging import acls
from alma_core.sdk import dead_letters as letters
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage.cache import RedisCheckpointCache, partition_key, run_key
from alma_core.storage.observer import Tally
from alma_core.types import WorkflowContext
from bench.ui import served
from tests.integration.conftest import TEST_PARTITIONS, Topics
from tests.integration.harness import Worker, count, event, fetch, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of
from tests.integration.test_kafka_security import (
    Secured,
    _as_admin,
    grant,
    secured,  # noqa: F401 - the module's secured broker (a fixture)
)
from tests.services import Services, without_alma_settings

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
            update={
                "tenant_topics": True,
                "group_prefix": worker.group_prefix,
                "redis_prefix": worker.redis_prefix,  # one cache, as in a deployment
            }
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
                    letters.ReplayChecks.of(t.tenants[tenant]),
                    tenant_id=tenant,
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

    # replayed by the workers' principal, which may read acme's topic and not write it:
    # the broker's refusal, named as one (not "cannot reach Kafka"), and nothing sent
    again = "SELECT max(id) FROM dead_letters WHERE reason = 'tenant_not_producer'"
    newest = (await fetch(database, again))[0][0]
    before = await _end_offsets(t, names.lifecycle_for("acme"))
    env = env_of(t.worker) | {"ALMA_POSTGRES_DSN": database}
    denied = await asyncio.to_thread(alma, "dlq", "replay", str(newest), "--force", env=env)
    assert denied.returncode == 1, denied.stdout
    lifecycle = names.lifecycle_for("acme")
    assert f"Kafka refused WRITE on topic '{lifecycle}' to User:worker" in denied.stderr
    assert "cannot publish" not in denied.stderr
    assert await _end_offsets(t, lifecycle) == before


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


# Every table that holds a tenant's rows (a table with a tenant_id column): a new one
# without the tenants' policy fails the catalog test below.
TENANT_TABLES = {
    "runs",
    "checkpoints",
    "run_heads",
    "run_events",
    "joins",
    "dead_letters",
    "reducer_configs",
    "graph_checkpoints",
    "graph_blobs",
    "graph_writes",
    "superseded_checkpoints",
    "tenant_settings",
    "tenant_storage",
    "tenant_roles",
    "memories",
    "workflow_outcomes",
    "artifact_links",
}


async def test_every_table_of_tenants_rows_is_bound_to_the_sessions_role(database: str) -> None:
    """The catalog: each table with a tenant_id column has row-level security on and a
    policy that lets alma_tenant read only the session's tenant; a table added without
    it fails here, not in a tenant's hands."""
    rows = await fetch(
        database,
        """SELECT c.table_name, k.relrowsecurity,
                  EXISTS (SELECT 1 FROM pg_policies p
                          WHERE p.tablename = c.table_name AND p.cmd = 'SELECT'
                            AND 'alma_tenant' = ANY (p.roles)
                            AND p.qual LIKE '%alma_session_tenant()%') AS bound
           FROM information_schema.columns c
           JOIN pg_class k ON k.relname = c.table_name AND k.relkind IN ('r', 'p')
           WHERE c.table_schema = current_schema() AND c.column_name = 'tenant_id'""",
    )
    assert {r["table_name"] for r in rows} == TENANT_TABLES
    assert [r["table_name"] for r in rows if not (r["relrowsecurity"] and r["bound"])] == []


def _as_role(dsn: str, role: str, password: str) -> str:
    parts = urlsplit(dsn)
    where = parts.hostname or "127.0.0.1"
    netloc = f"{quote(role)}:{quote(password)}@{where}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.mark.slow
async def test_a_tenants_database_role_reads_writes_and_replays_nothing_of_anothers(
    tenanted: Tenanted, database: str, services: Services
) -> None:
    """The read path bound to who asks: acme's orchestrator holds acme's Kafka principal
    and acme's PostgreSQL role (`alma tenants role acme ROLE`), never ALMA's credentials.
    Through each path it reads with (SQL itself, the SDK, the CLI, the inspector, MCP,
    dead-letter replay) it gets acme's rows and nothing of globex's, whatever tenant it
    names; its writes beyond its reducers and its letters' replays are refused."""
    t = tenanted
    names = t.worker.topic_names
    run = f"both-{uuid.uuid4().hex[:6]}"  # both tenants use the same run id
    async with Worker.start(t.worker, ("checkpointer", "joiner")):
        async with (
            AlmaClient(t.tenants["acme"]) as acme,
            AlmaClient(t.tenants["globex"]) as globex,
        ):
            for client, tenant, scale in ((acme, "acme", 1), (globex, "globex", 10)):
                await client.register_reducers(_ctx(tenant, run), {"n": "sum"})
                for branch, value in (("b0", 1), ("b1", 2)):
                    await client.node_completed(
                        _ctx(tenant, run, branch), updates={"n": value * scale}, wait="applied"
                    )
                await client.merge(_ctx(tenant, run), branch_ids=["b0", "b1"], timeout=60)
        for tenant, other in (("acme", "globex"), ("globex", "acme")):  # a letter each
            producer = t.producer(tenant)
            await producer.start()
            try:
                forged = event("node.completed", run, tenant=other, updates={"x": 1})
                await producer.send_and_wait(
                    names.lifecycle_for(tenant), json.dumps(forged).encode(), key=run.encode()
                )
            finally:
                await producer.stop()

        async def two_letters() -> bool:
            return await count(database, "SELECT count(*) FROM dead_letters") == 2

        await wait_for(two_letters, what="a dead letter of each tenant")

    owner = await asyncpg.connect(database)
    try:
        await owner.execute(
            """INSERT INTO memories (id, tenant_id, kind, content, dedupe_key)
               VALUES (gen_random_uuid(), 'acme', 'heuristic', 'acme knows', 'a'),
                      (gen_random_uuid(), 'globex', 'heuristic', 'globex secret', 'g');
               INSERT INTO tenant_settings (tenant_id, learner)
               VALUES ('acme', true), ('globex', false)"""
        )
        letter = {
            r["tenant_id"]: r["id"]
            for r in await owner.fetch("SELECT id, tenant_id FROM dead_letters")
        }
        role, password = f"acme_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        bound = alma("tenants", "role", "acme", role, env=env_of(t.worker))
        assert bound.returncode == 0, bound.stderr
        assert "without a password" in bound.stderr
        await owner.execute(f"ALTER ROLE \"{role}\" PASSWORD '{password}'")
        populated = {  # tables both tenants have rows in, as ALMA's own role sees them
            table
            for table in TENANT_TABLES
            if await owner.fetchval(
                f"SELECT count(DISTINCT tenant_id) FROM {table} "
                "WHERE tenant_id IN ('acme', 'globex')"
            )
            == 2
        }
        unfilled = {  # what this flow writes nothing to (LangGraph, replays, the learner)
            "graph_checkpoints",
            "graph_blobs",
            "graph_writes",
            "superseded_checkpoints",
            "workflow_outcomes",
            "artifact_links",
            "tenant_roles",  # acme's alone
        }
        assert populated == TENANT_TABLES - unfilled
    finally:
        await owner.close()
    own_dsn = _as_role(database, role, password)
    # and a Redis user of its own keys, as `alma tenants redis-acl` prints its ACL
    printed = alma("tenants", "redis-acl", "acme", "--user", role, env=env_of(t.worker))
    assert printed.returncode == 0, printed.stderr
    admin = aioredis.Redis.from_url(services.redis_url)
    try:
        assert await admin.execute_command(*shlex.split(printed.stdout), f">{password}")
    finally:
        await admin.aclose()
    own_redis = _as_role(services.redis_url, role, password)
    own = t.tenants["acme"].model_copy(update={"postgres_dsn": own_dsn, "redis_url": own_redis})
    async with RedisCheckpointCache.for_settings(own) as own_cache:
        p = own_cache.partition(run)
        for tenant, allowed in (("acme", True), ("globex", False)):
            key = partition_key(own.redis_prefix, p, f"h:{run_key(tenant, run)}")
            if allowed:
                assert await own_cache.client.hgetall(key), "acme's run is cached"
            else:
                with pytest.raises(redis_errors.NoPermissionError):
                    await own_cache.client.hgetall(key)
        with pytest.raises(redis_errors.NoPermissionError):
            await own_cache.client.keys("*")

    # SQL itself, whatever the session names: acme's rows only, and no write of globex's
    conn = await asyncpg.connect(own_dsn)
    try:
        for table in TENANT_TABLES:
            seen = {r[0] for r in await conn.fetch(f"SELECT tenant_id FROM {table}")}
            assert seen <= {"acme"}, table
            assert seen == {"acme"} or table not in populated, table
        async with conn.transaction():  # retrieval's own role, naming globex or all
            await conn.execute(
                "SELECT set_config('role', 'alma_reader', true), "
                "set_config('alma.tenant_id', 'globex', true), "
                "set_config('alma.all_tenants', 'on', true)"
            )
            assert await conn.fetch("SELECT content FROM memories") == []
        async with conn.transaction():
            await conn.execute(
                "SELECT set_config('role', 'alma_reader', true), "
                "set_config('alma.tenant_id', 'acme', true)"
            )
            assert [r[0] for r in await conn.fetch("SELECT content FROM memories")] == [
                "acme knows"
            ]
        for write in (
            "UPDATE runs SET status = 'failed'",
            "DELETE FROM checkpoints",
            "UPDATE tenant_settings SET learner = false",
            f"INSERT INTO tenant_roles (role_name, tenant_id) VALUES ('{role}2', 'globex')",
            "INSERT INTO reducer_configs (tenant_id, workflow_id, config) "
            "VALUES ('globex', 'wf', '{}')",
            "SELECT set_config('role', 'postgres', false)",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(write)
        assert await conn.execute("UPDATE dead_letters SET replayed_at = now()") == "UPDATE 1"
        await conn.execute("UPDATE dead_letters SET replayed_at = NULL")
    finally:
        await conn.close()
    assert await count(database, "SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL") == 2

    # the SDK: globex's run of the same id is not there; acme's is, from the cache
    tally = Tally()
    async with AlmaClient(own, observer=tally) as client:
        assert (await client.resume(_ctx("globex", run))).status is None
        assert dict(tally.counts) == {"cache_error": 1}  # Redis refused globex's key
        assert (await client.resume(_ctx("acme", run))).state == {"n": 3}
        assert dict(tally.counts) == {"cache_error": 1, "cache_hit": 1}
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await client.register_reducers(_ctx("globex", run), {"n": "max"})
        conn = await asyncpg.connect(own_dsn)
        try:  # dead-letter replay: globex's letter is not there, acme's own goes back
            with pytest.raises(errors.AlmaError, match="no dead letter"):
                await letters.replay(
                    conn, client.publish_record, letter["globex"], letters.ReplayChecks.of(own)
                )
            await letters.replay(
                conn,
                client.publish_record,
                letter["acme"],
                letters.ReplayChecks.of(own),
                tenant_id="acme",
                force=True,
            )
        finally:
            await conn.close()
    replayed = "SELECT tenant_id FROM dead_letters WHERE replayed_at IS NOT NULL"
    assert [r[0] for r in await fetch(database, replayed)] == ["acme"]

    # the CLI with acme's credentials
    env = env_of(own)
    for args in (
        ("runs", "list", "--tenant", "globex", "--json"),
        ("dlq", "list", "--tenant", "globex", "--json"),
    ):
        listed = alma(*args, env=env)
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) in ([], {"letters": [], "reasons": {}}), args
    mine = alma("runs", "list", "--tenant", "acme", "--json", env=env)
    assert [r["run_id"] for r in json.loads(mine.stdout)] == [run]
    refused = alma("dlq", "replay", str(letter["globex"]), "--tenant", "globex", env=env)
    assert refused.returncode != 0
    assert "no dead letter" in refused.stderr
    settings_refused = alma("tenants", "set", "globex", "--rate", "1", "--create", env=env)
    assert settings_refused.returncode == 1
    assert "a tenant's own role" in settings_refused.stderr
    shown = alma("tenants", "show", "acme", env=env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["roles"] == [role]

    # the inspector, started with acme's credentials, its proxy naming globex (wrongly)
    environ = {**without_alma_settings(), **env, "ALMA_METRICS_PORT": "0"}
    async with (
        served(environ, "--tenant-header", "X-Tenant") as base,
        httpx.AsyncClient(base_url=base) as http,
    ):
        for tenant, found in (("globex", 404), ("acme", 200)):
            page = await http.get("/run", params={"id": run}, headers={"X-Tenant": tenant})
            assert page.status_code == found, (tenant, page.text)
        page = await http.get("/dead-letters", headers={"X-Tenant": "globex"})
        assert page.status_code == 200
        assert str(letter["globex"]) not in page.text
        for tenant, held in (("globex", "0 (0 open)"), ("acme", "1 (1 open)")):
            page = await http.get("/tenant", headers={"X-Tenant": tenant})
            assert f"<tr><th>runs</th><td>{held}</td></tr>" in page.text, tenant

    # started with acme's credentials and no tenant named, the inspector is acme's
    async with served(environ) as base, httpx.AsyncClient(base_url=base) as http:
        assert (await http.get("/run", params={"id": run})).status_code == 200
        asked = {"id": run, "tenant": "globex"}
        assert (await http.get("/run", params=asked)).status_code == 404

    # MCP, started with acme's credentials
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "alma_core.cli", "mcp"], env=environ
    )
    async with Client(server, read_timeout_seconds=120) as mcp:
        asked = {"tenant_id": "globex", "workflow_id": "wf", "run_id": run}
        assert (await mcp.call_tool("alma_get_resume_point", asked)).is_error
        mine_point = await mcp.call_tool("alma_get_resume_point", {**asked, "tenant_id": "acme"})
        assert not mine_point.is_error, mine_point.content
