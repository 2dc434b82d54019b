"""A tenant is who produced the event (guarantee 9): with ``ALMA_TENANT_TOPICS`` each
tenant has its own lifecycle and reply topics, ``<lifecycle topic>.<tenant>`` and
``<merged topic>.<tenant>``, and Kafka's authorizer decides who may write and read
each (one principal per tenant, two literal ACLs). The tenant of an event is then the
topic it was read from: an event that claims another tenant than its topic's is
refused here, before anything of it is applied, and every rejection read from a
tenant's topic belongs to that tenant (its dead letter is listed and replayed as
that tenant's, never as the tenant it claimed). A join answers only on its tenant's
own reply topic.

Why topics and not a signature per event: the broker checks the producer's identity
already (SASL or mTLS), at no cost per event here; a tenant's credential is rotated
with Kafka's own tools (a new SCRAM password or certificate, the ACLs moved to a new
principal) with nothing to re-sign; and a tenant's replies are kept from the others by
the same ACLs, which a signature on the way in would not do. What it costs: two
topics per tenant, created with ``alma topics create --tenant``, each of
ALMA_PARTITIONS partitions (the cache is partitioned as the lifecycle topics are), and
a new tenant's topic is read within the checkpointer's metadata refresh
(:data:`DISCOVERY_MS`).

Pure: names and checks only, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from alma_core.schemas.decoder import Decoded, Rejection, RejectReason
from alma_core.schemas.events import BranchJoin

# The characters Kafka allows in a topic name; its longest name is 249 characters.
_TOPIC_SAFE = re.compile(r"[A-Za-z0-9._-]+")
MAX_TOPIC_CHARS = 249
DISCOVERY_MS = 10_000  # how often a checkpointer looks for new tenants' topics
TENANT_REFUSALS = frozenset(
    {RejectReason.TENANT_NOT_PRODUCER.value, RejectReason.REPLY_TO_REFUSED.value}
)


def tenant_topic(base: str, tenant_id: str) -> str:
    """``base``'s topic for ``tenant_id`` (``alma.lifecycle.v1`` → ``alma.lifecycle.v1.acme``)."""
    return f"{base}.{tenant_id}"


MAX_TENANT_ID = 256  # the event contract's id (schemas: 1 to 256 characters)


def tenant_problem(tenant_id: str, topics_base: str | None = None) -> str | None:
    """Why ``tenant_id`` can be no tenant: the contract's rule for an id (1 to 256
    characters, not only blanks) and, where tenants have topics (``topics_base``: the
    lifecycle topic under ALMA_TENANT_TOPICS), a Kafka topic's. The one rule the SDK,
    the command line and the tenant settings check; None when it can."""
    if not tenant_id.strip() or len(tenant_id) > MAX_TENANT_ID:
        shown = f"{tenant_id[:40]!r}..." if len(tenant_id) > 40 else repr(tenant_id)
        return (
            f"tenant id {shown} ({len(tenant_id)} characters) can be no tenant: an event's "
            f"tenant_id is 1 to {MAX_TENANT_ID} characters, not only blanks"
        )
    return None if topics_base is None else topic_problem(topics_base, tenant_id)


def topic_problem(base: str, tenant_id: str) -> str | None:
    """Why ``tenant_id`` can have no topic of its own under ``base``; None when it can."""
    if not _TOPIC_SAFE.fullmatch(tenant_id):
        return (
            f"tenant id {tenant_id!r} cannot name a Kafka topic: with ALMA_TENANT_TOPICS a "
            "tenant id holds only letters, digits, '.', '_' and '-'"
        )
    if tenant_id in (".", ".."):
        return f"tenant id {tenant_id!r} cannot name a Kafka topic"
    topic = tenant_topic(base, tenant_id)
    if len(topic) > MAX_TOPIC_CHARS:
        return (
            f"tenant id {tenant_id!r} makes the topic {topic!r} longer than Kafka's "
            f"{MAX_TOPIC_CHARS} characters"
        )
    return None


@dataclass(frozen=True)
class TenantTopics:
    """The topic names of one deployment: per tenant (``per_tenant``) or shared."""

    lifecycle: str
    replies: str
    per_tenant: bool = False

    def lifecycle_for(self, tenant_id: str) -> str:
        return tenant_topic(self.lifecycle, tenant_id) if self.per_tenant else self.lifecycle

    def replies_for(self, tenant_id: str) -> str:
        return tenant_topic(self.replies, tenant_id) if self.per_tenant else self.replies

    def lifecycle_pattern(self) -> str:
        """The regular expression a checkpointer subscribes to: every tenant's topic."""
        return rf"^{re.escape(self.lifecycle)}\.[A-Za-z0-9._-]+$"

    def tenant_of(self, topic: str) -> str | None:
        """The tenant whose lifecycle topic ``topic`` is; None for any other topic."""
        prefix = self.lifecycle + "."
        if not self.per_tenant or not topic.startswith(prefix) or len(topic) == len(prefix):
            return None
        return topic[len(prefix) :]

    def bind(self, topic: str, decoded: Decoded) -> Decoded:
        """``decoded`` as read from ``topic``: unchanged when topics are shared; else an
        event of another tenant than the topic's, or a join answering elsewhere than the
        tenant's reply topic, is a rejection; every rejection is the topic's tenant's."""
        if not self.per_tenant:
            return decoded
        producer = self.tenant_of(topic)
        if producer is None:  # not a tenant's topic: nobody may be trusted for it
            return _refused(
                decoded,
                RejectReason.TENANT_NOT_PRODUCER,
                f"read from {topic!r}, which is no tenant's lifecycle topic "
                f"({self.lifecycle}.<tenant>)",
                tenant_id=None,
            )
        if isinstance(decoded, Rejection):
            return replace(decoded, tenant_id=producer)
        if decoded.tenant_id != producer:
            return _refused(
                decoded,
                RejectReason.TENANT_NOT_PRODUCER,
                f"the event claims tenant {decoded.tenant_id!r} but was written to "
                f"{topic!r}, tenant {producer!r}'s topic: only {producer!r} is applied there",
                tenant_id=producer,
            )
        if isinstance(decoded, BranchJoin):
            own = self.replies_for(producer)
            asked = decoded.payload.reply_to
            if asked is not None and asked != own:
                return _refused(
                    decoded,
                    RejectReason.REPLY_TO_REFUSED,
                    f"reply_to {asked!r} is not tenant {producer!r}'s reply topic {own!r}: "
                    "leave reply_to out, or name that topic",
                    tenant_id=producer,
                )
        return decoded


def _refused(
    decoded: Decoded, reason: RejectReason, detail: str, *, tenant_id: str | None
) -> Rejection:
    return Rejection(
        reason,
        detail[:500],
        event_id=decoded.event_id,
        run_id=decoded.run_id,
        tenant_id=tenant_id,
    )
