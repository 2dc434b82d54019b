"""Replay to verify, in pure code: a run's events folded again give the same checkpoints
(merges included); another reducer configuration gives the expected differences. Replay
to migrate: the states a rebuild rewrites, and the runs it refuses (seqs that would
change)."""

from __future__ import annotations

import json
from typing import Any

from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.replay import Stored, first_difference, rebuild, refold, replay
from alma_core.sequencing import SHA256, RunView, canonical_state, hash_scheme, state_hash
from tests.unit.test_sequencing import ev

REGISTRY = ReducerRegistry()
SUMS = ReducerConfig(field_reducers={"n": "sum", "notes": "append"})


def run_view() -> RunView:
    return RunView("r", "acme", "wf", None)


def stored_of(states: list[tuple[str, dict[str, Any], str]]) -> dict[int, Stored]:
    """Checkpoints as stored: (kind, state, event id) by seq from 1."""
    return {
        seq: Stored(seq, kind, canonical_state(state)[1], state, event_id)
        for seq, (kind, state, event_id) in enumerate(states, start=1)
    }


def workload() -> tuple[list[Any], dict[int, Stored]]:
    """Events of a run with branches and a merge, and what the pipeline stored."""
    plan = ev(state={"n": 1, "notes": ["plan"]}, event_id="e1")
    a = ev(updates={"n": 2, "notes": ["a"]}, branch="A", event_id="e2")
    b = ev(updates={"n": 3, "notes": ["b"]}, branch="B", event_id="e3")
    join = ev("branch.join", join_id="j", branch_ids=["A", "B"], event_id="e4")
    after = ev(updates={"n": 4}, event_id="e5")
    stored = stored_of(
        [
            ("node", {"n": 1, "notes": ["plan"]}, "e1"),
            ("node", {"n": 2, "notes": ["a"]}, "e2"),
            ("node", {"n": 3, "notes": ["b"]}, "e3"),
            ("merge", {"n": 6, "notes": ["plan", "a", "b"]}, "e4"),
            ("node", {"n": 10, "notes": ["plan", "a", "b"]}, "e5"),
        ]
    )
    return [plan, a, b, join, after], stored


def test_the_same_core_makes_the_same_checkpoints_merges_included() -> None:
    events, stored = workload()
    verdict = replay(
        run_view(), events, stored, config=SUMS, registry=REGISTRY, max_state_bytes=10_000
    )
    assert (verdict.events, verdict.checkpoints, verdict.difference) == (5, 5, None)


def test_another_reducer_shows_where_and_how_the_state_would_differ() -> None:
    events, stored = workload()
    config = ReducerConfig(field_reducers={"n": "max", "notes": "append"})
    verdict = replay(
        run_view(), events, stored, config=config, registry=REGISTRY, max_state_bytes=10_000
    )
    assert verdict.difference is not None
    assert verdict.difference.to_doc() == {
        "seq": 4,  # the branches hold what they wrote; the merge is where max differs
        "what": "state",
        "path": "/n",
        "stored": 6,
        "replayed": 3,
        "detail": "",
    }


def test_an_event_refused_now_and_checkpoints_missing_or_extra_are_named() -> None:
    events, stored = workload()
    unknown = ReducerConfig(field_reducers={"n": "no_such_reducer"})
    verdict = replay(
        run_view(), events, stored, config=unknown, registry=REGISTRY, max_state_bytes=10_000
    )
    assert verdict.difference is not None
    assert (verdict.difference.seq, verdict.difference.what) == (2, "refused")
    assert "no_such_reducer" in verdict.difference.detail
    fewer = {s: c for s, c in stored.items() if s < 5}
    assert first_difference(stored, fewer).what == "missing"  # type: ignore[union-attr]
    assert first_difference(fewer, stored).what == "extra"  # type: ignore[union-attr]


MAXES = ReducerConfig(field_reducers={"n": "max", "notes": "append"})


def test_a_rebuild_rewrites_exactly_the_states_the_new_reducers_change() -> None:
    events, stored = workload()
    folded = refold(
        run_view(), events, stored, config=MAXES, registry=REGISTRY, max_state_bytes=10_000
    )
    plan = rebuild(stored, folded)
    assert plan.refused is None
    # the branches and the plan hold what they wrote; the merge and what follows change
    assert [(cp.seq, cp.kind, cp.state["n"]) for cp in plan.changed] == [
        (4, "merge", 3),
        (5, "node", 4),
    ]
    for cp in plan.changed:
        assert cp.state_hash == canonical_state(cp.state)[1]
    same = refold(
        run_view(), events, stored, config=SUMS, registry=REGISTRY, max_state_bytes=10_000
    )
    assert rebuild(stored, same).changed == []
    assert rebuild(stored, same).refused is None


def test_a_rebuild_that_would_change_the_runs_seqs_is_refused() -> None:
    events, stored = workload()
    # under sum, n goes 10 -> 12; under max, max(4, 2) is the head already: no checkpoint
    events.append(ev(updates={"n": 2}, event_id="e6"))
    stored[6] = Stored(6, "node", canonical_state({"n": 12})[1], {"n": 12}, "e6")
    folded = refold(
        run_view(), events, stored, config=MAXES, registry=REGISTRY, max_state_bytes=10_000
    )
    plan = rebuild(stored, folded)
    assert plan.changed == []
    assert plan.refused is not None
    assert (plan.refused.seq, plan.refused.what) == (6, "missing")

    unknown = ReducerConfig(field_reducers={"n": "no_such_reducer"})
    folded = refold(
        run_view(), events, stored, config=unknown, registry=REGISTRY, max_state_bytes=10_000
    )
    refused = rebuild(stored, folded).refused
    assert refused is not None
    assert (refused.seq, refused.what) == (2, "refused")


def test_a_run_stored_before_hash_schemes_replays_the_same() -> None:
    """A run whose checkpoints hold SHA-256 hashes is refolded in its own scheme (its new
    branches and its merge too): it verifies, and a rebuild changes nothing."""
    events, blake = workload()
    stored = {
        s: Stored(s, cp.kind, state_hash(cp.state, SHA256), cp.state, cp.event_id)
        for s, cp in blake.items()
    }
    for checkpoints in (stored, blake):
        verdict = replay(
            run_view(), events, checkpoints, config=SUMS, registry=REGISTRY, max_state_bytes=10_000
        )
        assert (verdict.events, verdict.checkpoints, verdict.difference) == (5, 5, None)
        folded = refold(
            run_view(), events, checkpoints, config=SUMS, registry=REGISTRY, max_state_bytes=10_000
        )
        assert rebuild(checkpoints, folded).changed == []
    assert all(hash_scheme(cp.state_hash) == SHA256 for cp in stored.values())


def test_a_state_that_differs_only_in_a_numbers_text_names_it() -> None:
    """Issue 51, item 1: -0.0 and 0.0 are equal in Python but not the same JSON (nor the
    same hash); 1e308 and 10**308 are not even equal. Replay names the path and both
    values, never "stored null, replayed null"."""
    for theirs, ours in ((0.0, -0.0), (10**308, 1e308), ([1, 0.0], [1, -0.0])):
        stored = {1: Stored(1, "node", state_hash({"v": theirs}), {"v": theirs}, "e1")}
        made = {1: Stored(1, "node", state_hash({"v": ours}), {"v": ours}, "e1")}
        found = first_difference(stored, made)
        assert found is not None
        assert found.path is not None
        assert found.path.startswith("/v")
        assert json.dumps(found.stored) != json.dumps(found.replayed)
    same = {1: Stored(1, "node", state_hash({"v": -0.0}), {"v": -0.0}, "e1")}
    assert first_difference(same, dict(same)) is None
