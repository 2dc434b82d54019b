"""Kafka security settings: what each protocol needs, and the options reaching every
kind of aiokafka client (built, not started: no network). Mutual TLS is exercised
end to end in tests/integration/test_kafka_tls.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from alma_core import errors, settings
from alma_core.messaging import kafka


def load(**values: Any) -> settings.Settings:
    return settings.load(**values)


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"kafka_security_protocol": "SASL_SSL"}, "needs ALMA_KAFKA_SASL_MECHANISM"),
        ({"kafka_sasl_mechanism": "PLAIN"}, "needs ALMA_KAFKA_SECURITY_PROTOCOL"),
        (
            {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512"},
            "ALMA_KAFKA_SASL_USERNAME and ALMA_KAFKA_SASL_PASSWORD",
        ),
        (
            {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "OAUTHBEARER"},
            "ALMA_KAFKA_SASL_OAUTH_TOKEN_FILE",
        ),
        ({"kafka_ssl_cafile": "/ca.pem"}, "does not use TLS"),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_keyfile": "/k.pem"},
            "needs ALMA_KAFKA_SSL_CERTFILE",
        ),
    ],
)
def test_what_each_protocol_needs(values: dict[str, Any], problem: str) -> None:
    with pytest.raises(errors.ConfigError, match=problem):
        load(**values)


def test_plaintext_adds_nothing() -> None:
    assert kafka.client_options(load()) == {}


async def test_sasl_scram_over_tls_reaches_every_client() -> None:
    s = load(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-256",
        kafka_sasl_username="alma",
        kafka_sasl_password="S3cretPW",
        kafka_ssl_check_hostname=False,
    )
    options = kafka.client_options(s)
    assert options["security_protocol"] == "SASL_SSL"
    assert options["ssl_context"].check_hostname is False
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", **options)
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", **options)
    admin = AIOKafkaAdminClient(bootstrap_servers="127.0.0.1:1", **options)
    for client in (producer.client, consumer._client, admin._client):
        assert client._security_protocol == "SASL_SSL"
        assert client._sasl_mechanism == "SCRAM-SHA-256"
        assert client._sasl_plain_username == "alma"
        assert client._sasl_plain_password == "S3cretPW"
        assert client._ssl_context is options["ssl_context"]
    await producer.stop()
    await consumer.stop()
    await admin.close()


async def test_oauthbearer_reads_the_token_file_each_time(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    s = load(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="OAUTHBEARER",
        kafka_sasl_oauth_token_file=token,
    )
    provider = kafka.client_options(s)["sasl_oauth_token_provider"]
    assert await provider.token() == "first"
    token.write_text("rotated")  # refreshed by whatever issues tokens
    assert await provider.token() == "rotated"
    token.write_text("")
    with pytest.raises(errors.ConfigError, match="is empty"):
        await provider.token()
    token.unlink()
    with pytest.raises(errors.ConfigError, match="ALMA_KAFKA_SASL_OAUTH_TOKEN_FILE"):
        await provider.token()


def test_secrets_never_show() -> None:
    s = load(
        postgres_dsn="postgresql://alma:S3cretPW@db:5432/alma",
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="PLAIN",
        kafka_sasl_username="alma",
        kafka_sasl_password="K4fkaPW",
    )
    shown = repr(s) + str(s) + s.model_dump_json()
    assert "S3cretPW" not in shown
    assert "K4fkaPW" not in shown
    assert "postgresql://alma:***@db:5432/alma" in repr(s)
    # another process gets the real values (alma up starts its workers so)
    env = s.to_env()
    assert env["ALMA_KAFKA_SASL_PASSWORD"] == "K4fkaPW"
    assert env["ALMA_POSTGRES_DSN"] == "postgresql://alma:S3cretPW@db:5432/alma"
    with pytest.raises(errors.ConfigError) as refused:
        load(postgres_dsn="mysql://alma:S3cretPW@db/alma")
    assert "S3cretPW" not in str(refused.value)
    assert "mysql://alma:***@db/alma" in str(refused.value)
