"""Connection options for every Kafka client ALMA Stream makes: the checkpointer's
consumers and producer, the SDK's producer and reply reader, the CLI's admin
clients, the lag exporter. One function reads the security settings, so a client
made anywhere connects the same way (plain, TLS, mutual TLS, SASL PLAIN, SCRAM or
OAUTHBEARER).

    AIOKafkaProducer(bootstrap_servers=..., **kafka.client_options(settings))
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.helpers import create_ssl_context

from alma_core import errors
from alma_core.settings import Settings


class FileTokenProvider(AbstractTokenProvider):  # type: ignore[misc]
    """OAUTHBEARER tokens read from a file each time one is needed: the file is kept
    fresh by whatever issues tokens (a projected service-account token, a sidecar),
    so a long-running worker never holds an expired one."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def token(self) -> str:
        try:
            text = await asyncio.to_thread(self.path.read_text)
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read the Kafka OAUTHBEARER token from {self.path}: {exc.strerror}; "
                "check ALMA_KAFKA_SASL_OAUTH_TOKEN_FILE"
            ) from exc
        token = text.strip()
        if not token:
            raise errors.ConfigError(
                f"the Kafka OAUTHBEARER token file {self.path} is empty; check what writes it"
            )
        return token


def ssl_context(s: Settings) -> ssl.SSLContext:
    """TLS for the brokers: the system's CAs unless ``ALMA_KAFKA_SSL_CAFILE`` names a
    bundle, a client certificate for mutual TLS when one is given."""
    password = s.kafka_ssl_key_password.get_secret_value() if s.kafka_ssl_key_password else None
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=s.kafka_ssl_cafile,
            certfile=s.kafka_ssl_certfile,
            keyfile=s.kafka_ssl_keyfile,
            password=password,
        )
    except (OSError, ssl.SSLError) as exc:
        raise errors.ConfigError(
            f"cannot set up TLS for Kafka: {exc}; check ALMA_KAFKA_SSL_CAFILE, "
            "ALMA_KAFKA_SSL_CERTFILE, ALMA_KAFKA_SSL_KEYFILE and ALMA_KAFKA_SSL_KEY_PASSWORD"
        ) from exc
    context.check_hostname = s.kafka_ssl_check_hostname
    return context


def producer_options(s: Settings) -> dict[str, Any]:
    """What every producer of ALMA's is made with: :func:`client_options`, every write
    acknowledged by all in-sync replicas, idempotence where the broker supports it
    (``ALMA_KAFKA_IDEMPOTENCE``: a retried batch is written once, in order), and batches
    compressed with ``ALMA_KAFKA_COMPRESSION``'s codec."""
    return {
        **client_options(s),
        "acks": "all",
        "enable_idempotence": s.kafka_idempotence,
        "compression_type": compression_type(s),
    }


def compression_type(s: Settings) -> str | None:
    """aiokafka's ``compression_type`` for ``ALMA_KAFKA_COMPRESSION`` (None: none)."""
    return None if s.kafka_compression == "none" else s.kafka_compression


def client_options(s: Settings) -> dict[str, Any]:
    """Keyword arguments for ``AIOKafkaProducer``, ``AIOKafkaConsumer`` and
    ``AIOKafkaAdminClient``: the security protocol and what it needs. Plain
    connections get none, so a client's own defaults stay as they are."""
    protocol = s.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol.endswith("SSL"):
        options["ssl_context"] = ssl_context(s)
    mechanism = s.kafka_sasl_mechanism
    if mechanism is not None:
        options["sasl_mechanism"] = mechanism
        if mechanism == "OAUTHBEARER":
            assert s.kafka_sasl_oauth_token_file is not None  # settings check it
            options["sasl_oauth_token_provider"] = FileTokenProvider(s.kafka_sasl_oauth_token_file)
        else:
            assert s.kafka_sasl_password is not None  # settings check it
            options["sasl_plain_username"] = s.kafka_sasl_username
            options["sasl_plain_password"] = s.kafka_sasl_password.get_secret_value()
    return options
