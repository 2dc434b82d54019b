"""The decoder: every input yields an event or a typed rejection, never an exception."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alma_core.schemas import (
    BranchJoin,
    NodeCompleted,
    Rejection,
    RejectReason,
    WorkflowCompleted,
    decode,
    encode,
)
from alma_core.schemas.events import EVENT_MODELS, EventType


def envelope(type_: str = "node.completed", **payload: Any) -> dict[str, Any]:
    return {
        "event_id": "e-1",
        "type": type_,
        "emitted_at": "2026-11-22T10:00:00Z",
        "tenant_id": "acme",
        "workflow_id": "wf",
        "run_id": "run-1",
        "node_id": "n1",
        "payload": payload or {"state": {"x": 1}},
    }


def raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def test_valid_node_completed() -> None:
    event = decode(raw(envelope(updates={"a": 1})), key=b"run-1")
    assert isinstance(event, NodeCompleted)
    assert event.payload.updates == {"a": 1}
    assert event.emitted_at.tzinfo is not None


def test_round_trip_through_encode() -> None:
    event = decode(raw(envelope(state={"x": [1, 2]}, expected_seq=3)))
    assert isinstance(event, NodeCompleted)
    assert decode(encode(event)) == event


@pytest.mark.parametrize(
    ("value", "reason", "path"),
    [
        (b"", RejectReason.EMPTY, None),
        (b"\xff\xfe", RejectReason.NOT_UTF8, None),
        (b"{not json", RejectReason.MALFORMED_JSON, None),
        (b'{"a": NaN}', RejectReason.MALFORMED_JSON, None),
        (b"[1, 2]", RejectReason.NOT_AN_OBJECT, None),
        (raw({**envelope(), "type": "node.exploded"}), RejectReason.UNKNOWN_TYPE, "type"),
        (
            raw({k: v for k, v in envelope().items() if k != "type"}),
            RejectReason.SCHEMA_VIOLATION,
            "type",
        ),
        (
            raw({k: v for k, v in envelope().items() if k != "tenant_id"}),
            RejectReason.SCHEMA_VIOLATION,
            "tenant_id",
        ),
        (
            raw({**envelope(), "emitted_at": "yesterday"}),
            RejectReason.SCHEMA_VIOLATION,
            "emitted_at",
        ),
        (
            raw({**envelope(), "emitted_at": "2026-11-22T10:00:00"}),
            RejectReason.SCHEMA_VIOLATION,
            "emitted_at",
        ),
        (raw(envelope(state={}, updates={})), RejectReason.SCHEMA_VIOLATION, "payload"),
        (raw(envelope(udpates={"a": 1})), RejectReason.SCHEMA_VIOLATION, "payload.udpates"),
        (
            raw(envelope(state={}, expected_seq="3")),
            RejectReason.SCHEMA_VIOLATION,
            "payload.expected_seq",
        ),
        (
            raw({**envelope("node.started"), "node_id": None}),
            RejectReason.SCHEMA_VIOLATION,
            "node_id",
        ),
        (raw(envelope("branch.join", join_id="j")), RejectReason.SCHEMA_VIOLATION, "payload"),
        (
            raw(envelope("node.failed", error={"type": "X"})),
            RejectReason.SCHEMA_VIOLATION,
            "payload.error.message",
        ),
    ],
)
def test_rejections(value: bytes, reason: RejectReason, path: str | None) -> None:
    result = decode(value)
    assert isinstance(result, Rejection), result
    assert result.reason == reason, result.describe()
    assert result.path == path
    assert result.detail


def test_rejection_keeps_the_ids_it_could_read() -> None:
    result = decode(raw({**envelope(), "type": "nope"}))
    assert isinstance(result, Rejection)
    assert (result.event_id, result.run_id, result.tenant_id) == ("e-1", "run-1", "acme")


def test_key_must_be_the_run_id() -> None:
    result = decode(raw(envelope()), key=b"other-run")
    assert isinstance(result, Rejection)
    assert result.reason == RejectReason.KEY_MISMATCH


def test_state_over_the_limit() -> None:
    big = raw(envelope(state={"blob": "x" * 5000}))
    result = decode(big, max_state_bytes=4096)
    assert isinstance(result, Rejection)
    assert result.reason == RejectReason.STATE_TOO_LARGE
    assert result.path == "payload.state"
    assert isinstance(decode(big, max_state_bytes=8192), NodeCompleted)


def test_join_state_over_the_limit_names_the_index() -> None:
    value = raw(envelope("branch.join", join_id="j", states=[{"a": 1}, {"b": "x" * 5000}]))
    result = decode(value, max_state_bytes=4096)
    assert isinstance(result, Rejection)
    assert result.path == "payload.states.1"


def test_a_join_naming_a_branch_twice_is_a_schema_violation_naming_it() -> None:
    """`sum` would add the branch twice (issue 51, item 6): refused, not merged."""
    value = raw(envelope("branch.join", join_id="j", branch_ids=["b0", "b1", "b0"]))
    result = decode(value)
    assert isinstance(result, Rejection), result
    assert result.reason == RejectReason.SCHEMA_VIOLATION
    assert "'b0'" in result.detail
    assert "twice" in result.detail
    ok = raw(envelope("branch.join", join_id="j", branch_ids=["b0", "b1"]))
    assert not isinstance(decode(ok), Rejection)


def test_record_over_the_record_limit_is_not_parsed() -> None:
    result = decode(b"{" + b" " * 10_000 + b"}", max_record_bytes=5000)
    assert isinstance(result, Rejection)
    assert result.reason == RejectReason.RECORD_TOO_LARGE


def test_deep_nesting_is_rejected_not_raised() -> None:
    result = decode(b"[" * 100_000 + b"]" * 100_000)
    assert isinstance(result, Rejection)
    assert result.reason == RejectReason.MALFORMED_JSON


def test_every_type_decodes() -> None:
    payloads: dict[EventType, dict[str, Any]] = {
        EventType.NODE_STARTED: {"attempt": 2},
        EventType.NODE_COMPLETED: {"updates": {"k": 1}},
        EventType.NODE_FAILED: {"error": {"type": "Timeout", "message": "slow"}},
        EventType.BRANCH_JOIN: {"join_id": "j", "branch_ids": ["a", "b"], "reducers": {"x": "sum"}},
        EventType.WORKFLOW_COMPLETED: {
            "outcome": "failure",
            "duration_ms": 5,
            "node_count": 3,
            "nodes_succeeded": 2,
            "nodes_failed": 1,
            "artifacts": [
                {
                    "id": "a",
                    "artifact_type": "log",
                    "storage_path": "s3://x",
                    "content_hash": "sha256:0",
                    "size_bytes": 1,
                }
            ],
        },
    }
    blob = {"type": "msgpack", "data": "kw=="}
    payloads |= {
        EventType.GRAPH_CHECKPOINT: {
            "checkpoint_id": "c1",
            "parent_checkpoint_id": "c0",
            "checkpoint": {"v": 4, "channel_versions": {"x": "1.0"}},
            "values": {"x": blob},
            "new_versions": {"x": "1.0"},
            "metadata": {"step": 1},
        },
        EventType.GRAPH_WRITES: {
            "checkpoint_id": "c1",
            "task_id": "t",
            "task_path": "~__pregel_pull, plan",
            "writes": [{"idx": -1, "channel": "__error__", "value": blob}],
            "replace": True,
            "error": {"type": "TimeoutError", "message": "slow"},
        },
        EventType.GRAPH_UPKEEP: {"op": "copy", "target_thread_id": "t2"},
    }
    assert set(payloads) == set(EventType)  # every type of the contract
    for type_, payload in payloads.items():
        event = decode(raw(envelope(type_.value, **payload)))
        assert isinstance(event, EVENT_MODELS[type_]), event
    join = decode(raw(envelope("branch.join", join_id="j", states=[{}])))
    assert isinstance(join, BranchJoin)
    done = decode(
        raw(
            envelope(
                "workflow.completed",
                outcome="success",
                duration_ms=1,
                node_count=1,
                nodes_succeeded=1,
                nodes_failed=0,
            )
        )
    )
    assert isinstance(done, WorkflowCompleted)


def test_node_counts_must_add_up() -> None:
    result = decode(
        raw(
            envelope(
                "workflow.completed",
                outcome="success",
                duration_ms=1,
                node_count=1,
                nodes_succeeded=2,
                nodes_failed=0,
            )
        )
    )
    assert isinstance(result, Rejection)
    assert result.reason == RejectReason.SCHEMA_VIOLATION


@given(st.binary(max_size=512))
def test_random_bytes_never_raise(value: bytes) -> None:
    result = decode(value)
    assert isinstance(result, Rejection)
    assert result.reason in set(RejectReason)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_random_json_never_raises(value: Any) -> None:
    result = decode(json.dumps(value).encode())
    assert isinstance(result, Rejection)  # random JSON is never a full valid envelope


@given(
    st.sampled_from([t.value for t in EventType]),
    st.dictionaries(
        st.sampled_from(
            [
                "event_id",
                "emitted_at",
                "tenant_id",
                "workflow_id",
                "run_id",
                "node_id",
                "branch_id",
                "payload",
                "extra",
            ]
        ),
        json_values,
        max_size=9,
    ),
)
def test_mutated_envelopes_yield_event_or_rejection(type_: str, overrides: dict[str, Any]) -> None:
    obj = {**envelope(type_), **overrides}
    result = decode(json.dumps(obj).encode())
    if isinstance(result, Rejection):
        assert result.reason in set(RejectReason)
        assert result.detail
    else:
        assert result.type == type_


def test_out_of_range_numbers_are_malformed() -> None:
    result = decode(raw(envelope(state={"x": 1})).replace(b'"x": 1', b'"x": 1e400'))
    assert isinstance(result, Rejection)
    assert result.reason == RejectReason.MALFORMED_JSON


def test_nul_characters_are_rejected_but_escaped_backslashes_are_not() -> None:
    nul = decode(raw(envelope(state={"x": "a\u0000b"})))
    assert isinstance(nul, Rejection)
    assert "U+0000" in nul.detail
    literal = decode(raw(envelope(state={"x": "a\\u0000b"})))
    assert isinstance(literal, NodeCompleted)


def test_lone_surrogates_are_rejected_but_pairs_are_not() -> None:
    lone = raw(envelope(state={"x": "X"})).replace(b'"X"', b'"\\ud800"')
    result = decode(lone)
    assert isinstance(result, Rejection)
    assert "surrogates" in result.detail
    pair = raw(envelope(state={"x": "X"})).replace(b'"X"', b'"\\ud83d\\ude00"')  # an emoji
    assert isinstance(decode(pair), NodeCompleted)


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"op": "copy"}, "copy needs target_thread_id"),
        ({"op": "prune"}, "prune needs strategy"),
        ({"op": "delete_runs"}, "delete_runs needs run_ids"),
        ({"op": "vacuum"}, "op"),
    ],
)
def test_a_graph_upkeep_without_its_argument_is_a_schema_violation(
    payload: dict[str, Any], says: str
) -> None:
    rejected = decode(raw(envelope("graph.upkeep", **payload)))
    assert isinstance(rejected, Rejection)
    assert rejected.reason == "schema_violation"
    assert says in rejected.detail
