"""A tenant is who produced the event (pure): with tenant topics, the topic an event was
read from names its tenant; a claim of another tenant, or a join answering on another
topic than its tenant's replies, is a rejection of the topic's tenant; and each tenant's
orchestrator is granted its own two topics, literally."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alma_core import errors
from alma_core.messaging import acls
from alma_core.schemas import Rejection, RejectReason, decode
from alma_core.settings import Settings
from alma_core.tenancy import TenantTopics, tenant_problem, topic_problem

TOPICS = TenantTopics("alma.lifecycle.v1", "alma.merged.v1", per_tenant=True)


def raw(tenant: str, type_: str = "node.completed", **payload: Any) -> bytes:
    return json.dumps(
        {
            "event_id": "e-1",
            "type": type_,
            "emitted_at": "2026-11-28T10:00:00Z",
            "tenant_id": tenant,
            "workflow_id": "wf",
            "run_id": "run-1",
            "node_id": "n1",
            "payload": payload or {"state": {"x": 1}},
        }
    ).encode()


def test_an_event_of_its_topics_tenant_is_applied_unchanged() -> None:
    event = decode(raw("acme"))
    assert TOPICS.bind("alma.lifecycle.v1.acme", event) is event


def test_an_event_claiming_another_tenant_is_the_producers_rejection() -> None:
    bound = TOPICS.bind("alma.lifecycle.v1.acme", decode(raw("globex")))
    assert isinstance(bound, Rejection)
    assert bound.reason is RejectReason.TENANT_NOT_PRODUCER
    assert bound.tenant_id == "acme"  # listed and replayed as acme's, never globex's
    assert (bound.event_id, bound.run_id) == ("e-1", "run-1")
    assert "claims tenant 'globex'" in bound.detail


def test_a_rejection_read_from_a_tenants_topic_is_that_tenants() -> None:
    bound = TOPICS.bind("alma.lifecycle.v1.acme", decode(b"{not json"))
    assert isinstance(bound, Rejection)
    assert bound.reason is RejectReason.MALFORMED_JSON
    assert bound.tenant_id == "acme"
    claimed = decode(raw("globex", state="not an object"))  # a schema violation
    assert isinstance(claimed, Rejection)
    assert claimed.tenant_id == "globex"
    assert TOPICS.bind("alma.lifecycle.v1.acme", claimed).tenant_id == "acme"


def test_an_event_without_a_tenant_on_a_tenants_topic_is_refused_as_that_tenants() -> None:
    """The contract requires tenant_id on every topic: not filled in from the topic."""
    doc = json.loads(raw("acme"))
    del doc["tenant_id"]
    bound = TOPICS.bind("alma.lifecycle.v1.acme", decode(json.dumps(doc).encode()))
    assert isinstance(bound, Rejection)
    assert bound.reason is RejectReason.SCHEMA_VIOLATION
    assert (bound.path, bound.detail) == ("tenant_id", "Field required")
    assert (bound.tenant_id, bound.event_id) == ("acme", "e-1")


def test_a_prefix_of_a_tenants_topic_is_no_tenants_topic() -> None:
    assert TOPICS.tenant_of("alma.lifecycle.v1.acme") == "acme"
    assert TOPICS.tenant_of("alma.lifecycle.v1.acme.eu") == "acme.eu"
    assert TOPICS.tenant_of("alma.lifecycle.v1.") is None
    assert TOPICS.tenant_of("alma.lifecycle.v1") is None
    assert TOPICS.tenant_of("alma.lifecycle.v10.acme") is None
    bound = TOPICS.bind("alma.lifecycle.v1", decode(raw("acme")))
    assert isinstance(bound, Rejection)
    assert bound.tenant_id is None
    assert bound.reason is RejectReason.TENANT_NOT_PRODUCER


def test_a_join_answers_only_on_its_tenants_reply_topic() -> None:
    def join(reply_to: str | None) -> Any:
        payload: dict[str, Any] = {"join_id": "j", "branch_ids": ["a", "b"]}
        if reply_to is not None:
            payload["reply_to"] = reply_to
        return decode(raw("acme", "branch.join", **payload))

    own = TOPICS.bind("alma.lifecycle.v1.acme", join("alma.merged.v1.acme"))
    assert not isinstance(own, Rejection)
    assert not isinstance(TOPICS.bind("alma.lifecycle.v1.acme", join(None)), Rejection)
    for elsewhere in ("alma.merged.v1.globex", "alma.merged.v1", "alma.dlq.v1"):
        refused = TOPICS.bind("alma.lifecycle.v1.acme", join(elsewhere))
        assert isinstance(refused, Rejection)
        assert refused.reason is RejectReason.REPLY_TO_REFUSED
        assert refused.tenant_id == "acme"


def test_shared_topics_bind_nothing() -> None:
    shared = TenantTopics("alma.lifecycle.v1", "alma.merged.v1")
    event = decode(raw("globex"))
    assert shared.bind("alma.lifecycle.v1", event) is event
    assert shared.lifecycle_for("acme") == "alma.lifecycle.v1"
    assert shared.replies_for("acme") == "alma.merged.v1"


@given(st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True))
def test_the_pattern_matches_exactly_the_tenants_topics(tenant: str) -> None:
    pattern = re.compile(TOPICS.lifecycle_pattern())
    topic = TOPICS.lifecycle_for(tenant)
    assert pattern.match(topic)
    if topic_problem(TOPICS.lifecycle, tenant) is None:
        assert TOPICS.tenant_of(topic) == tenant
    assert not pattern.match(TOPICS.replies_for(tenant))
    assert not pattern.match("alma.lifecycle.v1")


def test_a_tenant_id_that_cannot_name_a_topic_is_refused() -> None:
    assert topic_problem("alma.lifecycle.v1", "acme") is None
    assert "only letters" in (topic_problem("alma.lifecycle.v1", "acme corp") or "")
    assert topic_problem("alma.lifecycle.v1", "..") is not None
    assert "249" in (topic_problem("alma.lifecycle.v1", "a" * 240) or "")


def test_a_tenant_id_is_checked_by_the_contracts_rule_and_with_topics_by_kafkas() -> None:
    for tenant in ("", "   ", "x" * 257):
        assert "1 to 256 characters" in (tenant_problem(tenant) or "")
    assert tenant_problem("x" * 256) is None
    assert tenant_problem("bad tenant!") is None  # shared topics: the contract's rule only
    assert "only letters" in (tenant_problem("bad tenant!", "alma.lifecycle.v1") or "")
    assert tenant_problem("acme", "alma.lifecycle.v1") is None


def test_each_tenants_orchestrator_is_granted_its_own_topics_literally() -> None:
    s = Settings(tenant_topics=True, lifecycle_topic="lc", merged_topic="mg")
    granted = {(a.operation, a.name, a.prefixed) for a in acls.for_role("orchestrator", s, "acme")}
    assert granted == {
        ("WRITE", "lc.acme", False),
        ("DESCRIBE", "lc.acme", False),
        ("READ", "mg.acme", False),
        ("DESCRIBE", "mg.acme", False),
    }
    with pytest.raises(errors.ConfigError, match="--tenant"):
        acls.for_role("orchestrator", s)
    worker = {(a.operation, a.name, a.prefixed) for a in acls.for_role("worker", s)}
    assert {("READ", "lc.", True), ("WRITE", "mg.", True)} <= worker
    assert ("READ", "mg.", True) not in worker


def test_alma_tenant_is_checked_by_the_same_rule() -> None:
    with pytest.raises(ValueError, match="1 to 256 characters"):
        Settings(tenant="   ")
    assert Settings(tenant="acme").tenant == "acme"
