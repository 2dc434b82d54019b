"""The least a principal needs on an Apache Kafka with an authorizer, per role, and
what a refusal says: the one list that the docs print (``alma topics acls``), the
tests grant and an operator runs (``kafka-acls.sh``).

* **worker** (``alma worker``, ``alma up``'s workers): reads the lifecycle topic,
  reads and writes the sequenced topic, writes replies and dead letters, joins and
  commits the consumer groups ``<ALMA_GROUP_PREFIX>-*``, and describes the lifecycle
  topic's configuration (its retention, checked at start);
* **orchestrator** (the SDK, the Temporal plugin, the LangGraph saver): writes the
  lifecycle topic and reads its reply topic, by partition (no group), and nothing else.

Topics are created by whoever runs ``alma topics create`` (an admin principal), never by
these two. An idempotent producer needs nothing more than WRITE on its topics (Kafka
2.8+ dropped the cluster's IDEMPOTENT_WRITE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aiokafka import errors as aiokafka_errors

from alma_core import errors
from alma_core.settings import Settings

Role = Literal["worker", "orchestrator"]
ROLES: tuple[Role, ...] = ("worker", "orchestrator")


@dataclass(frozen=True)
class Acl:
    """Allow ``operation`` on the resource (``kind`` topic or group, ``name`` exact or,
    with ``prefixed``, a prefix)."""

    operation: Literal["READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS"]
    kind: Literal["topic", "group"]
    name: str
    prefixed: bool = False

    def command(self, principal: str, bootstrap: str = "BROKER:9092") -> str:
        """The ``kafka-acls.sh`` line that grants it to ``principal`` (User:NAME)."""
        pattern = " --resource-pattern-type prefixed" if self.prefixed else ""
        return (
            f"kafka-acls.sh --bootstrap-server {bootstrap} --add --allow-principal "
            f"{principal} --operation {_words(self.operation)} --{self.kind} "
            f"{self.name}{pattern}"
        )


def _words(operation: str) -> str:
    return "".join(part.capitalize() for part in operation.split("_"))


def for_role(role: Role, s: Settings, tenant: str | None = None) -> list[Acl]:
    """What ``role`` needs, for the topics and groups named in ``s``. With
    ALMA_TENANT_TOPICS an orchestrator is one tenant's (``tenant``, required): literal
    ACLs on that tenant's two topics only (a prefixed one on ``<topic>.acme`` would
    match ``<topic>.acme2`` as well); the workers read and answer every tenant's topics
    (prefixed on ``<topic>.``)."""
    names = s.topic_names
    if role == "orchestrator":
        if s.tenant_topics and tenant is None:
            raise errors.ConfigError(
                "with ALMA_TENANT_TOPICS an orchestrator's ACLs are one tenant's: pass "
                "--tenant (or set ALMA_TENANT)"
            )
        lifecycle = names.lifecycle_for(tenant or "")
        replies = names.replies_for(tenant or "")
        return [
            Acl("WRITE", "topic", lifecycle),
            Acl("DESCRIBE", "topic", lifecycle),
            Acl("READ", "topic", replies),
            Acl("DESCRIBE", "topic", replies),
        ]
    per_tenant = s.tenant_topics
    lifecycle = f"{s.lifecycle_topic}." if per_tenant else s.lifecycle_topic
    replies = f"{s.merged_topic}." if per_tenant else s.merged_topic
    return [
        Acl("READ", "topic", lifecycle, prefixed=per_tenant),
        Acl("DESCRIBE", "topic", lifecycle, prefixed=per_tenant),
        Acl("DESCRIBE_CONFIGS", "topic", lifecycle, prefixed=per_tenant),
        Acl("READ", "topic", s.sequenced_topic),
        Acl("WRITE", "topic", s.sequenced_topic),
        Acl("DESCRIBE", "topic", s.sequenced_topic),
        # and any other reply_to topic in use (not with tenant topics: none other)
        Acl("WRITE", "topic", replies, prefixed=per_tenant),
        Acl("DESCRIBE", "topic", replies, prefixed=per_tenant),
        Acl("WRITE", "topic", s.dlq_topic),
        Acl("DESCRIBE", "topic", s.dlq_topic),
        Acl("READ", "group", f"{s.group_prefix}-", prefixed=True),
        Acl("DESCRIBE", "group", f"{s.group_prefix}-", prefixed=True),
    ]


def principal(s: Settings) -> str:
    """Who this process is to the broker, as an ACL names it."""
    return f"User:{s.kafka_sasl_username}" if s.kafka_sasl_username else "this client"


def denied(who: str, acl: Acl, exc: BaseException) -> errors.BrokerDenied:
    """The error for a refusal to ``who`` (:func:`principal`): what was refused, and the
    line that grants it."""
    grant = acl.command(who if who.startswith("User:") else "User:<name>")
    return errors.BrokerDenied(
        f"Kafka refused {acl.operation} on {acl.kind} {acl.name!r} to {who} "
        f"({type(exc).__name__}): the principal lacks that ACL. What to do: grant it "
        f"({grant}); `alma topics acls --role worker|orchestrator` prints all that each "
        "role needs"
    )


# What aiokafka raises when the authorizer says no
REFUSALS: tuple[type[BaseException], ...] = (
    aiokafka_errors.TopicAuthorizationFailedError,
    aiokafka_errors.GroupAuthorizationFailedError,
    aiokafka_errors.ClusterAuthorizationFailedError,
)
