"""Scoring (weights, recency half-life) and scope filters, pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from alma_core import errors, scopes
from alma_core.memory import Memory, MemoryKind, WorkflowOutcome
from alma_core.scoring import (
    ScoringWeights,
    Signals,
    kind_signals,
    recency,
    run_signals,
    score,
    similarity_from_distance,
)
from alma_core.types import RetrievalScope, WorkflowContext

unit = st.floats(min_value=0, max_value=1)


def memory_signals(memory: Memory, distance: float, now: datetime) -> Signals:
    """A memory's signals from the item retrieval returns (it ranks rows before)."""
    when = memory.updated_at or memory.created_at
    return kind_signals(
        memory.kind, memory.occurrences, memory.successes, memory.confidence, when, distance, now
    )


def outcome_signals(outcome: WorkflowOutcome, distance: float, now: datetime) -> Signals:
    return run_signals(outcome.success, outcome.created_at, distance, now)


def test_recency_halves_every_half_life() -> None:
    assert recency(0, 30) == 1.0
    assert recency(30, 30) == pytest.approx(0.5)
    assert recency(60, 30) == pytest.approx(0.25)
    assert recency(-5, 30) == 1.0  # clocks disagree: the future counts as now


@given(
    unit,
    st.floats(min_value=0, max_value=10_000),
    unit,
    unit,
    st.sampled_from(["relevance", "weighted"]),
)
def test_score_is_within_zero_and_one(
    sim: float, age: float, rate: float, conf: float, ranking: str
) -> None:
    value = score(Signals(sim, age, rate, conf), ScoringWeights(ranking=ranking))  # type: ignore[arg-type]
    assert 0.0 <= value <= 1.0


ages = st.floats(min_value=0, max_value=3650)


@given(unit, unit, ages)
def test_a_more_similar_run_never_ranks_below_a_less_similar_one_because_it_failed(
    a: float, b: float, age: float
) -> None:
    """Relevance first: whether a run worked never decides whether it is shown."""
    if abs(a - b) < 1e-9:  # as good as equal in floats
        return
    now = datetime.now(UTC)
    when = now - timedelta(days=age)
    failed = WorkflowOutcome("1", "t", "w", "r1", False, 1, 3, 2, 1, "d", created_at=when)
    worked = WorkflowOutcome("2", "t", "w", "r2", True, 1, 3, 3, 0, "d", created_at=when)
    closer, farther = max(a, b), min(a, b)
    w = ScoringWeights()
    assert score(outcome_signals(failed, 1 - closer, now), w) > score(
        outcome_signals(worked, 1 - farther, now), w
    )
    # the seed's weighted sum buries it: what the default no longer does
    seed = ScoringWeights(ranking="weighted")
    assert score(outcome_signals(failed, 0.0, now), seed) < score(
        outcome_signals(worked, 0.3, now), seed
    )


@given(unit, unit, ages, ages, unit, unit)
def test_recency_and_confidence_only_order_items_of_similar_relevance(
    a: float, b: float, age_a: float, age_b: float, conf_a: float, conf_b: float
) -> None:
    w = ScoringWeights()
    first = score(Signals(a, age_a, 0.5, conf_a), w)
    second = score(Signals(b, age_b, 0.5, conf_b), w)
    if a > b + w.tie_band:
        assert first > second
    if b > a + w.tie_band:
        assert second > first


def test_within_the_band_the_fresher_and_surer_item_comes_first() -> None:
    w = ScoringWeights()
    old_unsure = score(Signals(0.81, 300, 0.5, 0.2), w)
    fresh_sure = score(Signals(0.80, 0, 0.5, 1.0), w)
    assert fresh_sure > old_unsure


def test_the_seeds_weighted_sum_is_a_setting() -> None:
    w = ScoringWeights(ranking="weighted")
    assert ScoringWeights().ranking == "relevance"
    assert (w.similarity, w.recency, w.success_rate, w.confidence) == (0.4, 0.3, 0.2, 0.1)
    assert w.half_life_days == 30
    assert score(Signals(1, 0, 1, 1), w) == pytest.approx(1.0)
    assert score(Signals(0.5, 0, 0, 0), w) == pytest.approx(0.2 + 0.3)


def test_weights_are_validated() -> None:
    with pytest.raises(ValidationError):
        ScoringWeights(similarity=-1)
    with pytest.raises(ValidationError):
        ScoringWeights(similarity=0, recency=0, success_rate=0, confidence=0)


def test_similarity_from_cosine_distance() -> None:
    assert similarity_from_distance(0) == 1.0
    assert similarity_from_distance(1) == 0.0
    assert similarity_from_distance(2) == 0.0


def test_signals_by_kind() -> None:
    now = datetime.now(UTC)
    h = Memory(
        "1",
        "t",
        MemoryKind.HEURISTIC,
        "x",
        occurrences=4,
        successes=3,
        confidence=0.75,
        updated_at=now - timedelta(days=30),
    )
    s = memory_signals(h, 0.2, now)
    assert (s.success_rate, s.confidence) == (0.75, 0.75)
    assert s.similarity == pytest.approx(0.8)
    assert s.age_days == pytest.approx(30)
    anti = Memory("2", "t", MemoryKind.ANTI_PATTERN, "y", occurrences=3, confidence=0.6)
    assert memory_signals(anti, 0.0, now).success_rate == 0.5  # neutral, not "failed"
    failed = WorkflowOutcome("3", "t", "w", "r", False, 1, 1, 0, 1, "d", created_at=now)
    assert outcome_signals(failed, 0.0, now).success_rate == 0.0


CTX = WorkflowContext("acme", "wf", None, "run-1", "node-1")


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        (RetrievalScope.NODE, {"tenant_id": "acme", "run_id": "run-1", "node_id": "node-1"}),
        (RetrievalScope.RUN, {"tenant_id": "acme", "run_id": "run-1"}),
        (RetrievalScope.WORKFLOW, {"tenant_id": "acme", "workflow_id": "wf"}),
        (RetrievalScope.AGENT, {"tenant_id": "acme", "agent": "planner"}),
        (RetrievalScope.TENANT, {"tenant_id": "acme"}),
    ],
)
def test_every_scope_is_filtered_by_tenant(scope: RetrievalScope, expected: dict[str, str]) -> None:
    f = scopes.memory_filter(CTX, scope, agent="planner")
    assert dict(f.conditions) == expected
    where, args = f.sql(3, "m")
    assert where.startswith("m.tenant_id = $3")
    assert args[0] == "acme"


def test_a_scope_without_its_context_field_is_refused() -> None:
    with pytest.raises(errors.ContextError, match="NODE scope needs node_id"):
        scopes.memory_filter(WorkflowContext("acme", "wf", None, "r"), RetrievalScope.NODE)
    with pytest.raises(errors.ContextError, match="AGENT scope needs an agent"):
        scopes.memory_filter(CTX, RetrievalScope.AGENT)
    with pytest.raises(errors.ContextError, match="tenant_id is required"):
        scopes.memory_filter(WorkflowContext(None, "wf"), RetrievalScope.WORKFLOW)
    with pytest.raises(errors.ContextError, match="multi-tenant"):
        scopes.memory_filter(CTX, RetrievalScope.GLOBAL)


def test_global_and_outcome_filters() -> None:
    g = scopes.memory_filter(CTX, RetrievalScope.GLOBAL, require_tenant=False)
    assert g.all_tenants
    assert g.conditions == ()
    assert g.sql(1) == ("TRUE", [])
    of = scopes.outcome_filter(CTX, scopes.memory_filter(CTX, RetrievalScope.NODE))
    assert dict(of.conditions) == {"tenant_id": "acme", "workflow_id": "wf"}
    assert of.admits({"tenant_id": "acme", "workflow_id": "wf", "run_id": "other"})
    assert not of.admits({"tenant_id": "globex", "workflow_id": "wf"})


@given(st.integers(min_value=1, max_value=9), st.sampled_from(["exact", "approximate"]))
def test_kind_groups_split_every_kind_once(fanout: int, plan: str) -> None:
    """A broad search's kinds, split over at most one connection per kind, each kind
    in one group, the groups as even as they can be; a small scope's exact scan reads
    every kind at once."""
    from alma_core.storage.retrieval import KINDS, kind_groups

    tenant = scopes.memory_filter(WorkflowContext("t"), RetrievalScope.TENANT)
    groups = kind_groups(plan, tenant, fanout)
    assert len(groups) == min(fanout, len(KINDS))
    assert [k for g in groups for k in g or ()] == list(KINDS)
    sizes = [len(g or ()) for g in groups]
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    run = scopes.memory_filter(WorkflowContext("t", "w", None, "r"), RetrievalScope.RUN)
    assert kind_groups(plan, run, fanout) == ([None] if plan == "exact" else groups)


moments = st.one_of(st.none(), st.datetimes(timezones=st.just(UTC), max_value=datetime(2030, 1, 1)))


@given(
    st.sampled_from(list(MemoryKind)),
    st.integers(min_value=0, max_value=50),
    st.integers(min_value=0, max_value=50),
    st.floats(min_value=-1, max_value=2),
    moments,
    moments,
    st.floats(min_value=0, max_value=2),
    st.booleans(),
)
def test_a_row_is_scored_as_the_item_built_from_it(
    kind: MemoryKind,
    occurrences: int,
    successes: int,
    confidence: float,
    created: datetime | None,
    updated: datetime | None,
    distance: float,
    success: bool,
) -> None:
    """Retrieval scores candidate rows and builds items for the kept ones only: a row's
    signals are the signals of the item built from it, for memories and outcomes."""
    from alma_core.storage import retrieval

    now = datetime(2026, 6, 1, tzinfo=UTC)
    row = {
        "id": "m",
        "tenant_id": "t",
        "kind": kind.value,
        "content": "c",
        "agent": None,
        "workflow_id": "w",
        "run_id": None,
        "node_id": None,
        "condition": None,
        "strategy": None,
        "occurrences": occurrences,
        "successes": successes,
        "confidence": confidence,
        "created_at": created,
        "updated_at": updated,
        "metadata": None,
        "distance": distance,
    }
    memory = retrieval._memory(row, 0.0, 0.0, ())
    assert retrieval._memory_signals(row, now) == memory_signals(memory, distance, now)
    run = {
        **row,
        "workflow_version": None,
        "success": success,
        "duration_ms": 1,
        "node_count": 1,
        "nodes_succeeded": 1,
        "nodes_failed": 0,
        "error_message": None,
        "failing_node": None,
        "task": None,
        "description": "d",
        "learnings_extracted": 0,
    }
    outcome = retrieval._outcome(run, 0.0, 0.0, ())
    assert retrieval._outcome_signals(run, now) == outcome_signals(outcome, distance, now)
