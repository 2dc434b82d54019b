"""How Temporal's identities and results map onto ALMA's events: pure rules (the
integration tests drive the same rules through a real Temporal server)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from temporalio.converter import DataConverter

from alma_core.integrations.temporal import mapping
from alma_core.integrations.temporal.mapping import NodeHeader, ResultNotJson

HEADER = NodeHeader(tenant_id="acme", workflow_id="Review", run_id="wf-1/run-1")


def test_a_run_is_the_workflow_id_and_the_run_id_and_fits_the_contract() -> None:
    assert mapping.run_id("invoice-42", "0190-abc") == "invoice-42/0190-abc"
    long = mapping.run_id("w" * 300, "0190-abc")
    assert len(long) <= mapping.ID_LIMIT
    assert long.endswith("/0190-abc")
    assert long == mapping.run_id("w" * 300, "0190-abc")  # stable
    assert long != mapping.run_id("w" * 299 + "x", "0190-abc")


@given(st.text(min_size=1), st.text(min_size=1), st.text(min_size=1), st.integers(1, 10**6))
def test_event_ids_are_stable_per_step_and_distinct_per_kind_and_attempt(
    workflow_id: str, run: str, step: str, attempt: int
) -> None:
    def make(kind: str, n: int | None = None) -> str:
        return mapping.event_id("default", workflow_id, run, step, kind, n)

    assert make("completed") == make("completed")  # a retried attempt: the same event
    assert (
        len(
            {
                make("started", attempt),
                make("started", attempt + 1),
                make("completed"),
                make("failed", attempt),
            }
        )
        == 4
    )
    assert len(make("started", attempt)) <= mapping.ID_LIMIT
    other = mapping.event_id("default", workflow_id, run, step + "x", "completed")
    assert other != make("completed")


@pytest.mark.parametrize(
    ("value", "options", "payload"),
    [
        ({"a": 1}, {}, {"updates": {"a": 1}}),
        ({"a": 1}, {"result": "state"}, {"state": {"a": 1}}),
        ("done", {}, {"updates": {"review": "done"}}),  # under the node id
        ([1, 2], {"key": "items"}, {"updates": {"items": [1, 2]}}),
        ({"a": 1, "b": 2}, {"key": "out"}, {"updates": {"out": {"a": 1, "b": 2}}}),
        ({"a": 1, "b": 2, "c": 3}, {"fields": ["a", "c"]}, {"updates": {"a": 1, "c": 3}}),
        (None, {}, {"updates": {}}),
        ({"a": 1}, {"result": "ignore"}, None),
    ],
)
def test_a_result_becomes_updates_or_state_as_the_author_says(
    value: Any, options: dict[str, Any], payload: dict[str, Any] | None
) -> None:
    header = NodeHeader(**{**HEADER.to_doc(), **options})
    assert mapping.node_payload(value, header, "review") == payload


def test_fields_of_a_result_that_is_no_dict_is_a_clear_error() -> None:
    header = NodeHeader(**{**HEADER.to_doc(), "fields": ["a"]})
    with pytest.raises(ResultNotJson, match="fields="):
        mapping.node_payload([1], header, "review")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"x": [float("-inf")]}])
def test_nan_and_infinity_are_not_json(bad: Any) -> None:
    with pytest.raises(ResultNotJson, match="result='ignore'"):
        mapping.checked_json(bad, "score")
    assert mapping.checked_json({"ok": [1.5, None, "x"]}, "score") == {"ok": [1.5, None, "x"]}


def test_the_header_round_trips_and_ignores_what_a_newer_workflow_adds() -> None:
    header = NodeHeader(
        "acme", "Review", "wf/run", "v2", "legal-review", "legal", "state", None, ["risk"]
    )
    doc = header.to_doc()
    assert NodeHeader.from_doc({**doc, "from_the_future": 1}) == header
    ctx = header.context("review")
    assert (ctx.node_id, ctx.branch_id, ctx.workflow_version) == ("legal-review", "legal", "v2")
    assert HEADER.context("review").node_id == "review"  # no name given: the activity type


def test_bytes_are_refused_as_a_result_and_a_list_of_integers_inside_one() -> None:
    """What docs/temporal.md says of bytes, through Temporal's own default converter."""
    converter = DataConverter.default.payload_converter
    with pytest.raises(ResultNotJson, match="binary/plain"):
        mapping.as_json(b"xy", "fetch", converter)
    assert mapping.as_json({"raw": b"xy"}, "fetch", converter) == {"raw": [120, 121]}
    with pytest.raises(ResultNotJson, match="cannot be converted"):
        mapping.as_json({"at": object()}, "fetch", converter)
