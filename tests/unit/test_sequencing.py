"""The sequencer: the pure rules that turn a run's events into checkpoints."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alma_core import errors
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.schemas.decoder import decode
from alma_core.schemas.events import Event
from alma_core.sequencing import (
    BLAKE3,
    MAIN,
    SHA256,
    Coordinates,
    Head,
    RunView,
    Sequencer,
    hash_scheme,
    refused_now,
    short_hash,
    state_hash,
)

AT = Coordinates("t", 0, 0)


def ev(type_: str = "node.completed", run: str = "r", **payload: Any) -> Event:
    doc: dict[str, Any] = {
        "event_id": payload.pop("event_id", uuid.uuid4().hex),
        "type": type_,
        "emitted_at": "2026-11-22T10:00:00Z",
        "tenant_id": payload.pop("tenant", "acme"),
        "workflow_id": payload.pop("workflow", "wf"),
        "run_id": run,
        "payload": payload,
    }
    if type_.startswith("node."):
        doc["node_id"] = "n"
    branch = payload.pop("branch", None)
    if branch:
        doc["branch_id"] = branch
    event = decode(json.dumps(doc).encode())
    assert not hasattr(event, "reason"), event
    return event  # type: ignore[return-value]


def sequencer(**kw: Any) -> Sequencer:
    return Sequencer(
        runs=kw.get("runs", {}),
        heads=kw.get("heads", {}),
        reducer_configs=kw.get("configs", {}),
        known_event_ids=kw.get("known", {}),
        registry=ReducerRegistry(),
        max_state_bytes=kw.get("limit", 10_000),
        over_quota=kw.get("over_quota", frozenset()),
        state_limits=kw.get("state_limits"),
    )


def test_seq_counts_from_the_run_row() -> None:
    run = RunView("r", "acme", "wf", None, last_seq=7)
    seq = sequencer(runs={("acme", "r"): run})
    seq.fold(ev(state={"a": 1}), AT)
    seq.fold(ev(state={"a": 2}), AT)
    assert [c.seq for c in seq.effects.checkpoints] == [8, 9]
    assert [c.parent_seq for c in seq.effects.checkpoints] == [None, 8]
    assert run.last_seq == 9


@given(st.lists(st.dictionaries(st.sampled_from("ab"), st.integers(0, 3), max_size=2), max_size=30))
def test_gapless_and_unchanged_states_skipped(states: list[dict[str, int]]) -> None:
    seq = sequencer()
    effects = [seq.fold(ev(state=s), AT) for s in states]
    written = [c.seq for c in seq.effects.checkpoints]
    assert written == list(range(1, len(written) + 1))
    expected = sum(1 for i, s in enumerate(states) if i == 0 or s != states[i - 1])
    assert len(written) == expected
    assert effects.count("unchanged") == len(states) - expected


def test_duplicate_event_id_has_no_effect() -> None:
    seq = sequencer(known={("acme", "old"): "r"})
    assert seq.fold(ev(state={"a": 1}, event_id="old"), AT) is None
    e = ev(state={"a": 2})
    seq.fold(e, AT)
    assert seq.fold(e, AT) is None
    assert seq.effects.duplicates == 2
    assert len(seq.effects.checkpoints) == 1


def test_an_event_id_another_run_used_is_refused_not_dropped() -> None:
    """Dropping it as a duplicate would lose the event and let applied() confirm it
    with the other run's seq."""
    seq = sequencer(known={("acme", "taken"): "other-run"})
    with pytest.raises(errors.EventIdReused, match="other-run"):
        seq.fold(ev(state={"a": 1}, event_id="taken"), AT)
    first = ev(state={"a": 1}, event_id="fresh")
    seq.fold(first, AT)
    with pytest.raises(errors.EventIdReused):  # within one batch too
        seq.fold(ev("node.completed", run="r2", state={"b": 1}, event_id="fresh"), AT)
    assert [c.event_id for c in seq.effects.checkpoints] == ["fresh"]


def test_a_run_is_its_tenant_and_its_id() -> None:
    """Two tenants may name a run, and an event, alike: each is its own."""
    globex = RunView("r", "globex", "wf", None, last_seq=9)
    seq = sequencer(runs={("globex", "r"): globex}, known={("globex", "e1"): "r"})
    assert seq.fold(ev(state={"a": 1}, event_id="e1"), AT) == "checkpointed"  # acme's r
    assert seq.effects.checkpoints[0].seq == 1
    assert (seq.effects.checkpoints[0].tenant_id, globex.last_seq) == ("acme", 9)
    assert seq.fold(ev(state={"a": 1}, event_id="e1", tenant="globex"), AT) is None  # its own


def test_updates_fold_per_branch_with_the_workflow_reducers() -> None:
    config = ReducerConfig(field_reducers={"log": "append", "n": "sum"})
    seq = sequencer(configs={("acme", "wf"): config})
    seq.fold(ev(updates={"log": ["main"], "n": 1}), AT)
    seq.fold(ev(updates={"log": ["a1"], "n": 1}, branch="A"), AT)
    seq.fold(ev(updates={"log": ["a2"], "n": 2}, branch="A"), AT)
    seq.fold(ev(updates={"log": ["main2"]}), AT)
    states = [(c.branch_id, c.state, c.parent_seq) for c in seq.effects.checkpoints]
    assert states == [
        (None, {"log": ["main"], "n": 1}, None),
        ("A", {"log": ["a1"], "n": 1}, 1),
        ("A", {"log": ["a1", "a2"], "n": 3}, 2),
        (None, {"log": ["main", "main2"], "n": 1}, 1),
    ]


def test_rejections_change_nothing() -> None:
    run = RunView("r", "acme", "wf", None, last_seq=3)
    head = Head(3, state_hash({"a": 1}), {"a": 1})
    seq = sequencer(runs={("acme", "r"): run}, heads={("acme", "r", MAIN): head}, limit=100)
    with pytest.raises(errors.StaleExpectedSeq, match="at seq 3"):
        seq.fold(ev(state={"a": 2}, expected_seq=2), AT)
    with pytest.raises(errors.StateTooLarge):
        seq.fold(ev(updates={"big": "x" * 200}), AT)
    with pytest.raises(errors.ReducerTypeError):
        sequencer(
            runs={("acme", "r"): run},
            heads={("acme", "r", MAIN): head},
            configs={("acme", "wf"): ReducerConfig({"a": "sum"})},
        ).fold(ev(updates={"a": "text"}), AT)
    with pytest.raises(errors.RejectedEvent, match="belongs to workflow"):
        seq.fold(ev(state={"a": 2}, workflow="other"), AT)
    assert run.last_seq == 3
    assert seq.effects.checkpoints == []
    assert seq.effects.events == []
    assert seq.fold(ev(state={"a": 2}, expected_seq=3), AT) == "checkpointed"


def test_failure_checkpoint_and_status() -> None:
    seq = sequencer()
    seq.fold(ev(updates={"a": 1}), AT)
    seq.fold(ev("node.failed", error={"type": "E", "message": "boom"}), AT)
    failure = seq.effects.checkpoints[-1]
    assert (failure.kind, failure.state, failure.metadata["error"]["type"]) == (
        "failure",
        {"a": 1},
        "E",
    )
    assert "attempt" not in failure.metadata
    assert seq.runs[("acme", "r")].status == "failed"
    seq.fold(ev("node.failed", error={"type": "E", "message": "again"}, attempt=2), AT)
    assert seq.effects.checkpoints[-1].metadata["attempt"] == 2  # which retry failed
    seq.fold(ev(updates={"a": 2}), AT)
    assert seq.runs[("acme", "r")].status == "running"
    seq.fold(
        ev(
            "workflow.completed",
            outcome="success",
            duration_ms=1,
            node_count=1,
            nodes_succeeded=1,
            nodes_failed=0,
        ),
        AT,
    )
    assert seq.runs[("acme", "r")].status == "succeeded"
    assert [h.event.type for h in seq.effects.handoffs] == ["workflow.completed"]


def test_a_langgraph_threads_events_are_recorded_in_order_once() -> None:
    """graph.* events (a LangGraph thread is a run) touch no checkpoint or head: they
    are recorded, handed to the store in their order, and a repeat has no effect."""
    run = RunView("r", "acme", "wf", None, last_seq=3)
    seq = sequencer(runs={("acme", "r"): run})
    value = {"type": "json", "data": "e30="}
    events = [
        ev("graph.checkpoint", checkpoint_id="c1", checkpoint={"v": 4}, values={"x": value}),
        ev(
            "graph.writes",
            checkpoint_id="c1",
            task_id="t",
            writes=[{"idx": 0, "channel": "x", "value": value}],
        ),
        ev("graph.upkeep", op="prune", strategy="keep_latest"),
    ]
    assert [seq.fold(e, AT) for e in events] == ["recorded"] * 3
    assert seq.fold(events[1], AT) is None
    assert [r.event for r in seq.effects.graph] == events
    assert seq.effects.checkpoints == []
    assert (run.last_seq, run.event_count) == (3, 3)
    with pytest.raises(errors.RejectedEvent, match="belongs to workflow"):
        seq.fold(ev("graph.upkeep", workflow="other", op="delete_thread"), AT)


def test_a_deleted_thread_frees_its_id_for_another_graph_and_only_then() -> None:
    """A thread deleted by its graph (delete_thread, prune "delete") is released: the
    next graph event of another workflow takes the run over (reopened if it was
    completed); a node event may not, and any event of the thread ends the release."""
    done = datetime(2026, 11, 22, tzinfo=UTC)
    run = RunView("r", "acme", "wf", None, status="succeeded", completed_at=done)
    seq = sequencer(runs={("acme", "r"): run})
    seq.fold(ev("graph.upkeep", op="prune", strategy="keep_latest"), AT)
    assert not run.released  # some checkpoints stay: still wf's
    with pytest.raises(errors.RejectedEvent, match="belongs to workflow 'wf'"):
        seq.fold(ev("graph.upkeep", workflow="other", op="delete_thread"), AT)
    seq.fold(ev("graph.upkeep", op="delete_thread"), AT)
    assert run.released
    with pytest.raises(errors.RejectedEvent, match="belongs to workflow 'wf'"):
        seq.fold(ev("node.started", workflow="other"), AT)
    assert (run.released, run.workflow_id) == (True, "wf")  # a refused event changed nothing
    seq.fold(ev("graph.checkpoint", workflow="other", checkpoint_id="c1", checkpoint={}), AT)
    assert (run.workflow_id, run.status, run.completed_at, run.released) == (
        "other",
        "running",
        None,
        False,
    )
    with pytest.raises(errors.RejectedEvent, match="belongs to workflow 'other'"):
        seq.fold(ev("graph.checkpoint", checkpoint_id="c2", checkpoint={}), AT)
    seq.fold(ev("graph.upkeep", workflow="other", op="prune", strategy="delete"), AT)
    seq.fold(ev("graph.checkpoint", workflow="other", checkpoint_id="c3", checkpoint={}), AT)
    assert (run.workflow_id, run.released) == ("other", False)  # its own graph goes on


def test_a_pruned_run_takes_no_more_events_but_a_known_one_stays_a_duplicate() -> None:
    """Retention deletes a closed run's inbox: an event replayed after that cannot be
    told from a new one, so the run refuses every event it does not still know."""
    run = RunView("r", "acme", "wf", None, last_seq=3, pruned=True)
    seq = sequencer(runs={("acme", "r"): run}, known={("acme", "kept"): "r"})
    assert seq.fold(ev(state={"a": 1}, event_id="kept"), AT) is None
    for late in (
        ev(state={"a": 2}),
        ev("node.started"),
        ev("node.failed", error={"type": "X", "message": "m"}),
    ):
        with pytest.raises(errors.RunPruned, match="new run id"):
            seq.fold(late, AT)
    assert (run.last_seq, seq.effects.checkpoints, seq.effects.events) == (3, [], [])
    other = sequencer(runs={("globex", "r"): RunView("r", "globex", "wf", None, pruned=True)})
    assert other.fold(ev(state={"a": 1}), AT) == "checkpointed"  # another tenant's run


def test_a_tenant_at_its_storage_quota_begins_no_run_and_a_refused_run_stays_refused() -> None:
    """At its storage quota a tenant's new run is refused, its row kept as ``refused``
    (nothing else written), so that its later events are refused too once the tenant has
    room again (they would else apply without the events before them); its runs begun
    before go on, and another tenant's new runs are not held."""
    going = RunView("old", "acme", "wf", None, last_seq=2)
    full = sequencer(runs={("acme", "old"): going}, over_quota=frozenset({"acme"}))
    with pytest.raises(errors.StorageQuotaExceeded, match="alma tenants set acme"):
        full.fold(ev(state={"a": 1}, run="new"), AT)
    refused = full.runs[("acme", "new")]
    assert (refused.status, refused.changed, refused.last_seq, refused.event_count) == (
        "refused",
        True,
        0,
        0,
    )
    assert (full.effects.checkpoints, full.effects.events) == ([], [])
    assert full.fold(ev(state={"a": 3}, run="old"), AT) == "checkpointed"  # begun before
    assert full.fold(ev(state={"a": 1}, run="new", tenant="globex"), AT) == "checkpointed"
    # later, with room: the refused run's next events are refused all the same
    room = sequencer(runs={("acme", "new"): RunView("new", "acme", "wf", None, "refused")})
    for late in (ev("node.started", run="new"), ev(state={"a": 2}, run="new")):
        with pytest.raises(
            errors.StorageQuotaExceeded, match="alma dlq replay --run new --tenant acme"
        ):
            room.fold(late, AT)
    assert (room.effects.checkpoints, room.effects.events) == ([], [])
    assert room.fold(ev(state={"a": 1}, run="other"), AT) == "checkpointed"


def test_a_tenants_own_state_limit_holds_for_its_states_alone() -> None:
    """Below the global limit a tenant's own refuses a state (given, or folded from
    updates) the global one admits, naming whose limit it is; other tenants keep the
    global one; nothing of the refused event is written."""
    big = {"text": "x" * 2_000}  # under the global 10,000
    seq = sequencer(state_limits={"small": 1_024})
    with pytest.raises(errors.StateTooLarge, match="the tenant's own limit is 1024"):
        seq.fold(ev(state=big, tenant="small"), AT)
    assert seq.fold(ev(state={"a": 1}, tenant="small"), AT) == "checkpointed"
    with pytest.raises(errors.StateTooLarge, match="own limit"):
        seq.fold(ev(updates=big, tenant="small"), AT)
    assert [c.tenant_id for c in seq.effects.checkpoints] == ["small"]
    assert seq.fold(ev(state=big), AT) == "checkpointed"  # acme: the global limit
    with pytest.raises(errors.StateTooLarge, match="the limit is 10000"):
        seq.fold(ev(state={"text": "x" * 20_000}, run="r2"), AT)


def completion(outcome: str = "success", **kw: Any) -> Event:
    return ev(
        "workflow.completed",
        outcome=outcome,
        duration_ms=1,
        node_count=1,
        nodes_succeeded=1,
        nodes_failed=0,
        **kw,
    )


def test_a_completed_run_refuses_more_work_but_a_replay_stays_a_duplicate() -> None:
    """After its workflow.completed, a run takes no node event or join (a script run
    again with the same run id must not fold into the finished state); an event applied
    before the end and delivered again is still a duplicate; a second completion is
    recorded and the first outcome stands; a LangGraph thread's graph.* events go on."""
    seq = sequencer()
    assert seq.fold(ev(updates={"total": 42}, event_id="before"), AT) == "checkpointed"
    assert seq.fold(completion(), AT) == "handed_off"
    run = seq.runs[("acme", "r")]
    for late in (
        ev(updates={"total": 42}),
        ev("node.started"),
        ev("node.failed", error={"type": "X", "message": "m"}),
        ev("branch.join", join_id="j", branch_ids=["a"]),
    ):
        with pytest.raises(errors.RunCompleted, match="new run id"):
            seq.fold(late, AT)
    assert seq.fold(ev(updates={"total": 42}, event_id="before"), AT) is None
    assert seq.fold(completion("failure"), AT) == "recorded"
    assert run.status == "succeeded"
    assert [h.event.type for h in seq.effects.handoffs] == ["workflow.completed"]
    assert [c.seq for c in seq.effects.checkpoints] == [1]
    upkeep = ev("graph.upkeep", op="delete_thread")
    assert seq.fold(upkeep, AT) == "recorded"


def test_a_stored_run_keeps_its_hash_scheme_and_a_new_run_takes_blake3() -> None:
    """Hash schemes (docs/guarantees.md): a run stored before them (SHA-256 heads) is
    compared like with like, so an unchanged state stays unchanged, and its new checkpoints
    and new branches hash as its old ones did; a new run hashes with BLAKE3."""
    old_state = {"a": 1, "f": 1e-05}
    stored = RunView("old", "acme", "wf", None, last_seq=3)
    heads = {("acme", "old", MAIN): Head(3, state_hash(old_state, SHA256), old_state)}
    seq = sequencer(runs={("acme", "old"): stored}, heads=heads)
    assert seq.fold(ev(run="old", state=dict(reversed(old_state.items()))), AT) == "unchanged"
    assert seq.fold(ev(run="old", state={"a": 2}), AT) == "checkpointed"
    assert seq.fold(ev(run="old", updates={"b": 1}, branch="B"), AT) == "checkpointed"
    seq.fold(ev("node.failed", run="old", error={"type": "E", "message": "m"}), AT)
    seq.fold(ev(run="new", state=old_state), AT)
    assert seq.fold(ev(run="new", state=dict(old_state)), AT) == "unchanged"
    schemes = [(c.run_id, c.branch_id, hash_scheme(c.state_hash)) for c in seq.effects.checkpoints]
    assert schemes == [
        ("old", None, SHA256),
        ("old", "B", SHA256),
        ("old", None, SHA256),
        ("new", None, BLAKE3),
    ]
    assert seq.effects.checkpoints[0].state_hash == state_hash({"a": 2}, SHA256)
    assert seq.effects.checkpoints[-1].state_hash == state_hash(old_state, BLAKE3)


def test_a_short_hash_keeps_its_scheme() -> None:
    new, old = state_hash({"a": 1}), state_hash({"a": 1}, SHA256)
    assert short_hash(new) == new[: len("blake3:") + 12]
    assert short_hash(new).startswith("blake3:")
    assert short_hash(old) == old[:12]


def test_what_a_replayed_dead_letter_would_meet_is_told_before_it_is_sent() -> None:
    """refused_now applies the sequencer's own rules to the run as it stands: the run's
    end and a stale expected_seq refuse; a run that caught up, or is not there yet, not."""
    early = ev(updates={"k": 1}, expected_seq=2)
    assert refused_now(early, status="running", completed=False, last_seq=2) is None
    stale = refused_now(early, status="running", completed=False, last_seq=3)
    assert isinstance(stale, errors.StaleExpectedSeq)
    assert "is at seq 3, the event expects 2" in stale.message
    ended = refused_now(ev(state={}), status="succeeded", completed=True, last_seq=5)
    assert isinstance(ended, errors.RunCompleted)
    assert refused_now(early, status=None, completed=False, last_seq=0) is None
    # the sequencer refuses the same events for the same reasons
    run = RunView("r", "acme", "wf", None, last_seq=3)
    with pytest.raises(errors.StaleExpectedSeq):
        sequencer(runs={("acme", "r"): run}).fold(early, AT)
