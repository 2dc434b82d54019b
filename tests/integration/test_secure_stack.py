"""A shared ALMA stood up by its operator in one command, walked as the README's
"A shared ALMA" section does: `alma up --secure` (Apache Kafka with SASL/SCRAM over
TLS and its authorizer, PostgreSQL and Redis asking passwords), two tenants given
their access by `alma tenants add`, each running a workflow with nothing but the
settings printed for it; a forged event dead-lettered as its producer's, a read of
the other tenant's replies and rows refused; `alma tenants remove` taking a tenant's
access away. Every service real, every command a subprocess, as an operator types it."""

from __future__ import annotations

import json
import re
import shlex
import stat
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAuthorizationFailedError
from aiokafka.helpers import create_ssl_context

from alma_core.cli.embedded_process import port_open
from alma_core.messaging import kafka, kafka_admin
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings, load
from alma_core.types import WorkflowContext
from tests.integration.harness import completed, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_embedded import AlmaUp
from tests.readme_blocks import shell_commands

pytestmark = pytest.mark.slow


def test_the_readme_walkthrough_is_this_walk() -> None:
    """The README's shell block on `alma up --secure` shows the commands the test below
    runs, in its order (each run there as printed: `>` is the shell's)."""
    assert shell_commands(secured=True) == [
        ["up", "--secure"],
        ["tenants", "add", "acme", ">", "acme.env"],
        ["tenants", "add", "globex", ">", "globex.env"],
        ["dlq", "list", "--tenant", "acme"],
        ["tenants", "remove", "globex"],
    ]


def tenant_settings(printed: str) -> tuple[dict[str, str], Settings]:
    """The lines `alma tenants add` printed (KEY=VALUE, shell-quoted), and the settings
    an orchestrator loads from them."""
    env = dict(line.split("=", 1) for line in printed.splitlines() if line)
    env = {k: shlex.split(v)[0] for k, v in env.items()}
    fields: dict[str, Any] = {k.removeprefix("ALMA_").lower(): v for k, v in env.items()}
    return env, load(**fields)


async def replies_read(s: Settings, topic: str) -> int:
    """How many records of ``topic`` a consumer with ``s``'s credentials reads in ~3 s."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=s.kafka_bootstrap, auto_offset_reset="earliest", **kafka.client_options(s)
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(s.partitions)])
        read = 0
        for _ in range(6):
            batches = await consumer.getmany(timeout_ms=500)
            read += sum(len(records) for records in batches.values())
        return read
    finally:
        await consumer.stop()


async def signs_in(s: Settings) -> bool:
    """Whether a producer with ``s``'s credentials connects (aiokafka says a refused
    sign-in as a failed bootstrap; its log names SaslAuthenticationFailed)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=s.kafka_bootstrap, request_timeout_ms=5000, **kafka.client_options(s)
    )
    try:
        await producer.start()
    except KafkaConnectionError:
        return False
    finally:
        await producer.stop()
    return True


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_an_operator_stands_up_a_shared_alma_and_two_tenants(tmp_path: Path) -> None:
    up = AlmaUp(tmp_path, args=("--secure",))
    try:
        endpoints = await up.start()
        data = tmp_path / ".alma"
        # the stack's secrets are its owner's only
        assert endpoints["kafka_security_protocol"] == "SASL_SSL"
        assert mode(data / "secure") == 0o700
        for private in ("credentials.json", "ca.key", "broker.key"):
            assert mode(data / "secure" / private) == 0o600, private
        assert mode(data / "kafka" / "server.properties") == 0o600
        assert mode(up.endpoints_file) == 0o600
        for url in (endpoints["postgres_dsn"], endpoints["redis_url"]):
            assert ":***@" not in url
            assert "@127.0.0.1" in url  # a user and its password before it
        # nobody gets in without credentials: Kafka, PostgreSQL and Redis alike
        bare = AIOKafkaProducer(bootstrap_servers=endpoints["kafka_bootstrap"])
        with pytest.raises(KafkaError):
            await bare.start()
        await bare.stop()
        host_port = endpoints["postgres_dsn"].rsplit("@", 1)[1]
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(f"postgresql://postgres@{host_port}", timeout=10)

        # nor into the controller's listener: mutual TLS, the broker's certificate only
        config = (data / "kafka" / "server.properties").read_text()
        controller = int(re.search(r"CONTROLLER://127\.0\.0\.1:(\d+)", config).group(1))
        assert port_open(controller)
        no_certificate = AIOKafkaAdminClient(
            bootstrap_servers=f"127.0.0.1:{controller}",
            security_protocol="SSL",
            ssl_context=create_ssl_context(cafile=str(data / "secure" / "ca.pem")),
            request_timeout_ms=5000,
        )
        with pytest.raises(KafkaConnectionError):
            await no_certificate.start()
        await no_certificate.close()

        added = {}
        for tenant in ("acme", "globex"):
            result = alma("tenants", "add", tenant, cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            assert f"Kafka principal User:{tenant} with 4 ACLs" in result.stderr
            added[tenant] = tenant_settings(result.stdout)
        listed = alma("tenants", "list", "--json", cwd=tmp_path)
        assert [t["tenant_id"] for t in json.loads(listed.stdout)] == ["acme", "globex"]
        acme_env, acme = added["acme"]
        _, globex = added["globex"]
        assert acme_env["ALMA_KAFKA_SASL_USERNAME"] == "acme"
        assert acme_env["ALMA_TENANT_TOPICS"] == "true"
        assert acme_env["ALMA_PARTITIONS"] == "4"  # the stack's (AlmaUp's), not the default
        assert acme.kafka_sasl_password is not None
        password = acme.kafka_sasl_password.get_secret_value()
        assert password not in (tmp_path / "up.out").read_text()
        for path in data.rglob("*"):  # printed once, kept nowhere
            if path.is_file() and path.stat().st_size < 10_000_000:
                assert password.encode() not in path.read_bytes(), path

        # each tenant runs a workflow with its own settings alone
        runs = {}
        for tenant, s in (("acme", acme), ("globex", globex)):
            run = WorkflowContext(
                tenant_id=tenant, workflow_id="research", run_id=f"run-{uuid.uuid4().hex[:8]}"
            )
            async with AlmaClient(s) as client:
                node = replace(run, node_id="fetch")
                await client.node_started(node, attempt=1)
                await client.node_completed(node, updates={"pages": 3}, wait="applied")
                assert (await client.resume(run)).state == {"pages": 3}
                reply = await client.merge(
                    replace(run, node_id="join"), states=[{"a": 1}, {"b": 2}]
                )
                assert reply.merged_state == {"a": 1, "b": 2}
            runs[tenant] = run

        # acme forges an event of globex's: dead-lettered as acme's, nothing of globex's
        forged = completed(runs["globex"].run_id, tenant="globex", updates={"pages": 0})
        async with AlmaClient(acme) as client:
            await client.publish_record(
                "alma.lifecycle.v1.acme",
                json.dumps(forged).encode(),
                runs["globex"].run_id.encode(),
            )

        def letters() -> list[dict[str, Any]]:
            shown = alma("dlq", "list", "--tenant", "acme", "--json", cwd=tmp_path)
            assert shown.returncode == 0, shown.stderr
            found: list[dict[str, Any]] = json.loads(shown.stdout)
            return found

        async def dead_lettered() -> bool:
            return any(letter["event_id"] == forged["event_id"] for letter in letters())

        await wait_for(dead_lettered, limit_s=60, what="the forged event dead-lettered")
        shown = alma("dlq", "list", "--tenant", "acme", cwd=tmp_path)  # as the README shows it
        assert shown.returncode == 0, shown.stderr
        assert "tenant_not_producer" in shown.stdout
        [letter] = [x for x in letters() if x["event_id"] == forged["event_id"]]
        assert letter["reason"] == "tenant_not_producer"
        state = alma(
            "runs",
            "state",
            runs["globex"].run_id,
            "--seq",
            "1",
            "--tenant",
            "globex",
            "--json",
            cwd=tmp_path,
        )
        assert state.returncode == 0, state.stderr
        assert json.loads(state.stdout)["state"] == {"pages": 3}  # unchanged

        # acme cannot read globex's replies (globex can: the reply is there), nor its rows
        replies = "alma.merged.v1.globex"
        assert await replies_read(globex, replies) > 0
        assert await replies_read(acme, replies) == 0
        async with kafka_admin.connected(acme.kafka_bootstrap, acme) as admin:
            [described] = await admin.describe_topics([replies])
        assert described["error_code"] == TopicAuthorizationFailedError.errno
        as_acme = {k: v for k, v in acme_env.items() if k != "ALMA_TENANT"}
        seen = alma("runs", "show", runs["globex"].run_id, "--tenant", "globex", env=as_acme)
        assert seen.returncode == 1, seen.stderr
        assert f"no checkpoints for run {runs['globex'].run_id!r}" in seen.stderr
        own = alma("runs", "show", runs["acme"].run_id, "--tenant", "acme", env=as_acme)
        assert own.returncode == 0, own.stderr

        # the operator takes globex's access away: none of its credentials works now
        removed = alma("tenants", "remove", "globex", cwd=tmp_path)
        assert removed.returncode == 0, removed.stderr
        assert "removed 4 ACLs; principal User:globex's sign-in; topics" in removed.stdout
        assert await signs_in(acme)  # the broker is there: acme's credentials work
        assert not await signs_in(globex)
        assert globex.postgres_dsn is not None
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
            await asyncpg.connect(globex.postgres_dsn, timeout=10)
        again = alma("tenants", "remove", "globex", cwd=tmp_path)
        assert again.returncode == 1
        assert "no access to take away" in again.stderr

        # acme's go on, across a restart of the stack (its users are on disk)
        code = await up.stop()
        assert code == 0, up.stderr()[-3000:]
        up = AlmaUp(tmp_path)  # no --secure: the data directory stays secured
        await up.start()
        assert "holds a secured stack" in up.stderr()
        assert "is taken" not in up.stderr()  # the same ports: the printed settings hold
        async with AlmaClient(acme) as client:
            node = replace(runs["acme"], node_id="write")
            await client.node_completed(node, updates={"words": 9}, wait="applied")
            assert (await client.resume(runs["acme"])).state == {"a": 1, "b": 2, "words": 9}
    finally:
        code = await up.stop()
    assert code == 0, up.stderr()[-3000:]
    assert not up.endpoints_file.exists()
