"""The secured stack's secrets and its refusals (alma_core/cli/embedded_secure.py), and
how a command beside a secured `alma up` takes its broker's credentials
(alma_core/settings.secured_by). The stack itself: tests/integration/test_secure_stack.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from alma_core import errors, settings
from alma_core.cli import embedded_secure
from alma_core.cli.embedded_secure import ADMIN, WORKER


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_made_once_private_and_read_back(tmp_path: Path) -> None:
    made = embedded_secure.load_or_make(tmp_path)
    home = tmp_path / "secure"
    assert mode(home) == 0o700
    for private in ("credentials.json", "ca.key", "broker.key", "users.acl"):
        assert mode(home / private) == 0o600, private
    assert set(made.kafka) == {ADMIN, WORKER}
    passwords = [*made.kafka.values(), made.postgres, made.redis]
    assert len(set(passwords)) == 4  # each its own
    assert all(len(p) >= 32 for p in passwords)
    assert made.redis not in (home / "users.acl").read_text()  # Redis keeps its hash
    again = embedded_secure.load_or_make(tmp_path)
    assert again == made
    assert embedded_secure.made_secure(tmp_path)
    assert not embedded_secure.made_open(tmp_path)


def test_the_broker_certificate_is_the_stack_cas_for_loopback(tmp_path: Path) -> None:
    made = embedded_secure.load_or_make(tmp_path)
    ca = x509.load_pem_x509_certificate(made.ca.read_bytes())
    broker = x509.load_pem_x509_certificate((made.folder / "broker.pem").read_bytes())
    public = ca.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    broker.verify_directly_issued_by(ca)
    names = broker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]


def test_secure_refuses_what_it_cannot_secure(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="ALMA_POSTGRES_DSN names services of your own"):
        embedded_secure.check_can_secure(
            settings.load(data_dir=tmp_path, postgres_dsn="postgresql://db/alma")
        )
    with pytest.raises(errors.ConfigError, match="in-memory broker"):
        embedded_secure.check_can_secure(settings.load(data_dir=tmp_path, embedded_broker="tansu"))
    (tmp_path / "postgres").mkdir()
    (tmp_path / "postgres" / "PG_VERSION").write_text("18\n")  # made without --secure
    with pytest.raises(errors.ConfigError, match="made without --secure"):
        embedded_secure.check_can_secure(settings.load(data_dir=tmp_path))
    embedded_secure.load_or_make(tmp_path / "other")
    embedded_secure.check_can_secure(settings.load(data_dir=tmp_path / "other"))


def test_a_command_beside_a_secured_stack_is_its_admin_unless_told_otherwise(
    tmp_path: Path,
) -> None:
    made = embedded_secure.load_or_make(tmp_path)
    found = {"kafka_bootstrap": "127.0.0.1:9093", "partitions": 4, **made.endpoints_entry()}
    beside = settings.secured_by(settings.load(), found)
    assert beside.partitions == 4  # the stack's, so a tenant's topics match its workers'
    assert settings.secured_by(settings.load(partitions=6), found).partitions == 6
    assert beside.kafka_security_protocol == "SASL_SSL"
    assert beside.kafka_sasl_username == ADMIN
    assert beside.kafka_sasl_password is not None
    assert beside.kafka_sasl_password.get_secret_value() == made.kafka[ADMIN]
    assert beside.kafka_ssl_cafile == made.ca
    assert beside.tenant_topics
    orchestrator = settings.load(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="acme",
        kafka_sasl_password="its-own",
    )
    kept = settings.secured_by(orchestrator, found)
    assert kept.kafka_sasl_username == "acme"  # its own principal, never the admin's
    plain = settings.secured_by(settings.load(), {"kafka_bootstrap": "127.0.0.1:9092"})
    assert plain.kafka_security_protocol == "PLAINTEXT"
    assert not plain.tenant_topics
