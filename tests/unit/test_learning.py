"""The learning protocol's pure decisions: strategies, error signatures, drafts
and the thresholds for heuristics and anti-patterns."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from alma_core import learning
from alma_core.learning import FinishedRun, HistoryEvent, LearningPolicy
from alma_core.memory import MemoryKind


def run(success: bool = True, **kw: object) -> FinishedRun:
    base: dict[str, object] = {
        "tenant_id": "acme",
        "workflow_id": "wf",
        "run_id": "r1",
        "event_id": "e1",
        "success": success,
        "duration_ms": 2500,
        "node_count": 3,
        "nodes_succeeded": 3 if success else 1,
        "nodes_failed": 0 if success else 1,
        "task": "summarise papers",
    }
    base.update(kw)
    return FinishedRun(**base)  # type: ignore[arg-type]


def test_strategy_is_the_order_nodes_first_completed() -> None:
    history = [
        HistoryEvent("node.completed", "fetch"),
        HistoryEvent("node.failed", "parse", error_type="E", error_message="x"),
        HistoryEvent("node.completed", "parse"),  # a retry that succeeded
        HistoryEvent("node.completed", "fetch"),  # again: counted once
        HistoryEvent("node.completed", "summarise"),
    ]
    assert learning.strategy_of(history) == "fetch → parse → summarise"
    assert learning.strategy_of([]) == "(no completed node)"


def test_error_signature_masks_what_varies() -> None:
    a = learning.error_signature("parse", "ValueError", "bad tag at line 42 (id 0xdeadbeef)")
    b = learning.error_signature("parse", "ValueError", "Bad tag at line 7  (id 0x1f)")
    c = learning.error_signature("parse", "KeyError", "bad tag at line 42 (id 0xdeadbeef)")
    d = learning.error_signature("fetch", "ValueError", "bad tag at line 42 (id 0xdeadbeef)")
    assert a == b
    assert len({a, c, d}) == 3


@given(st.text(max_size=2000))
def test_mask_is_bounded_and_stable(message: str) -> None:
    masked = learning.mask(message)
    assert len(masked) <= 300
    assert learning.mask(message) == masked


def test_draft_of_a_failed_run() -> None:
    history = [
        HistoryEvent("node.completed", "fetch"),
        HistoryEvent("node.failed", "parse", error_type="ValueError", error_message="bad tag 3"),
    ]
    d = learning.draft(run(success=False), history)
    assert d.failing_node == "parse"
    assert d.strategy == "fetch"
    assert "failing node parse: ValueError: bad tag 3" in d.description
    assert "task: summarise papers" in d.description
    assert d.anti_pattern is not None
    assert d.anti_pattern.node_id == "parse"
    assert d.anti_pattern.kind is MemoryKind.ANTI_PATTERN
    assert [m.node_id for m in d.node_outcomes] == ["parse"]
    assert d.node_outcomes[0].run_id == "r1"
    texts = d.texts()
    assert texts[0] == d.description
    assert d.anti_pattern.content in texts


def test_draft_of_a_successful_run_has_no_anti_pattern_and_stable_ids() -> None:
    history = [HistoryEvent("node.completed", n) for n in ("a", "b")]
    d1 = learning.draft(run(), history)
    d2 = learning.draft(run(run_id="r2", event_id="e2"), history)
    assert d1.anti_pattern is None
    assert d1.failing_node is None
    assert d1.node_outcomes == []
    assert d1.heuristic.id == d2.heuristic.id, "one heuristic per workflow and strategy"
    assert d1.id != d2.id
    assert d1.id == learning.draft(run(), history).id


def test_heuristic_threshold_follows_the_seed() -> None:
    policy = LearningPolicy(min_occurrences=3)
    assert not learning.heuristic_counts_qualify(2, 2, policy)  # too few successes
    assert learning.heuristic_counts_qualify(3, 3, policy)
    assert learning.heuristic_counts_qualify(5, 3, policy)  # 60% > 50%
    assert not learning.heuristic_counts_qualify(6, 3, policy)  # 50% is not above 50%
    assert not learning.heuristic_counts_qualify(0, 0, policy)


def test_anti_pattern_confidence_grows_with_repetitions() -> None:
    assert learning.anti_pattern_confidence(2) == 0.4
    assert learning.anti_pattern_confidence(5) == 1.0
    assert learning.anti_pattern_confidence(50) == 1.0


def failed_draft(run_id: str, message: str = "timeout after 30 s") -> learning.OutcomeDraft:
    history = [
        HistoryEvent("node.completed", "fetch"),
        HistoryEvent("node.failed", "parse", error_type="Timeout", error_message=message),
    ]
    return learning.draft(run(success=False, run_id=run_id), history)


def ok_draft(run_id: str) -> learning.OutcomeDraft:
    return learning.draft(run(run_id=run_id), [HistoryEvent("node.completed", "fetch")])


def test_memory_plan_follows_the_counts_of_the_stored_outcomes() -> None:
    policy = LearningPolicy()
    ok = ok_draft("r1")
    strategy = ("acme", "wf", ok.strategy)
    # two successes so far: no heuristic yet, the counts are only refreshed
    early = learning.plan_memories([ok], {strategy: (2, 2)}, {}, policy)
    assert early.upserts == {}
    assert [(r.occurrences, r.successes) for r in early.fading] == [(2, 2)]
    assert early.learned == {ok.id: 0}
    # the third success makes it a heuristic with confidence 1
    third = learning.plan_memories([ok], {strategy: (3, 3)}, {}, policy)
    row = third.upserts[ok.heuristic.id]
    assert (row.draft.kind, row.occurrences, row.confidence) == (MemoryKind.HEURISTIC, 3, 1.0)
    assert third.learned == {ok.id: 1}


def test_memory_plan_learns_an_anti_pattern_once_a_failure_repeats() -> None:
    policy = LearningPolicy()
    first, second = failed_draft("r1"), failed_draft("r2", "timeout after 45 s")
    assert first.error_signature == second.error_signature  # numbers masked
    assert first.anti_pattern is not None
    signature = ("acme", "wf", first.error_signature or "")
    once = learning.plan_memories([first], {}, {signature: (1, 1)}, policy)
    assert first.anti_pattern.id not in once.upserts
    assert once.learned == {first.id: 1}  # its node outcome only
    twice = learning.plan_memories([first, second], {}, {signature: (2, 2)}, policy)
    anti = twice.upserts[first.anti_pattern.id]
    assert (anti.occurrences, anti.confidence) == (2, 0.4)
    # a failed run refreshes its strategy's counts but never counts as learned from it
    assert [m.kind for m in (r.draft for r in twice.fading)] == [MemoryKind.HEURISTIC] * 2
    node_outcomes = [r for r in twice.upserts.values() if r.draft.kind is MemoryKind.OUTCOME]
    assert len(node_outcomes) == 2  # one per run: each run's own failure record
