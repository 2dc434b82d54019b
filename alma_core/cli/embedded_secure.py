"""The secured embedded stack (``alma up --secure``): what it is made of, made once per
data directory and kept in ``<data dir>/secure`` (mode 0700):

* a CA of its own (``ca.pem``; its key ``ca.key``, 0600) and the broker's certificate
  for 127.0.0.1 and localhost (``broker.pem``, ``broker.key``), with which Apache
  Kafka's client listener speaks TLS; clients trust ``ca.pem``;
* Kafka principals authenticated by SASL/SCRAM-SHA-512, under Kafka's own authorizer
  (nothing allowed that no ACL allows): ``alma-admin`` (a super user: topics, ACLs,
  users; what the ``alma`` commands beside ``alma up`` act as) and ``alma-worker`` (the
  workers, granted exactly the worker role's ACLs: alma_core/messaging/acls.py); each
  tenant's own principal is added by ``alma tenants add``;
* PostgreSQL asking a password (SCRAM) of every connection, ALMA's own included, and
  Redis one of every client (its users in ``users.acl``, which ``ACL SAVE`` keeps up to
  date: a tenant's user outlives a restart);
* ``credentials.json`` (0600): the stack's own passwords, generated. A tenant's
  password is printed once by ``alma tenants add`` and kept nowhere by ALMA.

A data directory made with ``--secure`` stays secured (``alma up`` on it secures it
again); one made without it is refused, because its PostgreSQL trusts every local
connection.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from alma_core import errors
from alma_core.cli.embedded_kafka import BROKER_PRINCIPAL, Security
from alma_core.cli.embedded_process import write_private
from alma_core.settings import SECURED_FIELDS, Settings

FOLDER = "secure"
ADMIN = "alma-admin"
WORKER = "alma-worker"
STACK_PRINCIPALS = (ADMIN, WORKER)
MECHANISM = "SCRAM-SHA-512"
CERT_DAYS = 825  # what browsers and most TLS stacks accept for a leaf certificate


def folder(data_dir: Path) -> Path:
    return data_dir / FOLDER


def made_secure(data_dir: Path) -> bool:
    """Whether ``data_dir`` holds a stack made with ``--secure``."""
    return (folder(data_dir) / "credentials.json").exists()


def made_open(data_dir: Path) -> bool:
    """Whether ``data_dir`` holds a stack made without ``--secure`` (its services'
    data exist, its secrets do not)."""
    held = [data_dir / "kafka" / "log" / "meta.properties", data_dir / "postgres" / "PG_VERSION"]
    return not made_secure(data_dir) and any(p.exists() for p in held)


def new_password() -> str:
    """A generated password: 32 URL-safe characters (192 bits)."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Secrets:
    """The secured stack's CA, broker certificate and passwords (see the module)."""

    folder: Path
    kafka: dict[str, str]  # principal -> password: the stack's own (ADMIN first)
    postgres: str
    redis: str

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def redis_acl_file(self) -> Path:
        return self.folder / "users.acl"

    def security(self) -> Security:
        return Security(
            dict(self.kafka), self.folder / "broker.pem", self.folder / "broker.key", self.ca
        )

    def settings_for(self, s: Settings, principal: str) -> Settings:
        """``s`` connecting to this stack's broker as ``principal``, tenant topics on."""
        return s.model_copy(update={"tenant_topics": True, **self.kafka_fields(principal)})

    def kafka_fields(self, principal: str) -> dict[str, Any]:
        """The Kafka settings of ``principal`` (Settings' field names)."""
        return {
            "kafka_security_protocol": "SASL_SSL",
            "kafka_sasl_mechanism": MECHANISM,
            "kafka_sasl_username": principal,
            "kafka_sasl_password": SecretStr(self.kafka[principal]),
            "kafka_ssl_cafile": self.ca,
        }

    @property
    def ports_file(self) -> Path:
        return self.folder / "ports.json"

    def remembered_ports(self) -> dict[str, int]:
        """The ports each service had last time: a tenant's printed settings name them."""
        try:
            return {str(k): int(v) for k, v in json.loads(self.ports_file.read_text()).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def remember_ports(self, ports: dict[str, int]) -> None:
        self.ports_file.write_text(json.dumps(ports))

    def endpoints_entry(self) -> dict[str, Any]:
        """What the endpoints file says of the broker's security, for the commands beside
        ``alma up`` (they act as the admin: the file is its owner's only)."""
        values = ("SASL_SSL", MECHANISM, ADMIN, self.kafka[ADMIN], str(self.ca))
        return dict(zip(SECURED_FIELDS, values, strict=True))  # what secured_by reads


def load_or_make(data_dir: Path) -> Secrets:
    """The secrets of the secured stack on ``data_dir``, made the first time."""
    home = folder(data_dir.resolve())
    stored = home / "credentials.json"
    if stored.exists():
        try:
            doc = json.loads(stored.read_text())
            return Secrets(home, dict(doc["kafka"]), str(doc["postgres"]), str(doc["redis"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise errors.StackError(
                f"{stored} is unreadable ({exc}). What to do: restore it from a backup; "
                f"without it the stack's services cannot be reached (remove {data_dir} to "
                "start a new stack: this deletes what it holds)"
            ) from exc
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    home.chmod(0o700)
    made = Secrets(
        home,
        {ADMIN: new_password(), WORKER: new_password()},
        postgres=new_password(),
        redis=new_password(),
    )
    make_pki(home)
    # the default user of Redis, by its password's SHA-256 (Redis's own ACL file form)
    digest = hashlib.sha256(made.redis.encode()).hexdigest()
    write_private(made.redis_acl_file, f"user default on #{digest} ~* &* +@all\n")
    doc = {"kafka": made.kafka, "postgres": made.postgres, "redis": made.redis}
    write_private(stored, json.dumps(doc, indent=2))  # last: its presence says "made"
    return made


def make_pki(home: Path) -> None:
    """A CA (``ca.pem``, ``ca.key``) and the broker's certificate (``broker.pem``,
    ``broker.key``), EC P-256, written in ``home``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name(f"ALMA Stream CA ({home.parent.name})"))
        .issuer_name(name(f"ALMA Stream CA ({home.parent.name})"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    broker = (
        x509.CertificateBuilder()
        .subject_name(name(BROKER_PRINCIPAL.removeprefix("CN=")))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    pkcs8, plain = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    write_private(home / "ca.key", ca_key.private_bytes(pem, pkcs8, plain))
    write_private(home / "broker.key", key.private_bytes(pem, pkcs8, plain))
    (home / "ca.pem").write_bytes(ca.public_bytes(pem))
    (home / "broker.pem").write_bytes(broker.public_bytes(pem))


def check_can_secure(s: Settings) -> None:
    """Refuse ``--secure`` where it cannot hold: services of one's own (secure them
    oneself), the in-memory broker (Tansu has no authorizer), or a data directory made
    without it."""
    given = [
        name
        for name, value in (
            ("ALMA_KAFKA_BOOTSTRAP", s.kafka_bootstrap),
            ("ALMA_POSTGRES_DSN", s.postgres_dsn),
            ("ALMA_REDIS_URL", s.redis_url),
        )
        if value
    ]
    if given:
        raise errors.ConfigError(
            f"--secure secures the embedded services, and {', '.join(given)} names services of "
            "your own. What to do: unset it, or secure your own services as docs/operations.md "
            "('Tenants') describes and run `alma worker` against them"
        )
    if s.embedded_broker == "tansu":
        raise errors.ConfigError(
            "--secure needs Apache Kafka (SASL/SCRAM, TLS and an authorizer); the in-memory "
            "broker (tansu) has none of them. What to do: drop --broker tansu "
            "(ALMA_EMBEDDED_BROKER), and run `make kafka` if Apache Kafka's jars are missing"
        )
    if made_open(s.data_dir.resolve()):
        raise errors.ConfigError(
            f"{s.data_dir} holds a stack made without --secure (its PostgreSQL trusts every "
            "local connection, its broker every client). What to do: give the secured stack "
            "a data directory of its own (--data-dir or ALMA_DATA_DIR), or run this one "
            "without --secure"
        )
