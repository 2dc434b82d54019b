"""Join semantics, next to the most used peer (LangGraph's parallel branches).

Where ALMA matches LangGraph: writes of parallel branches are applied in a
deterministic order that does not depend on completion order; reducers fold
branch writes onto the state as it was before the fan-out.
Where it deliberately differs: the order is the one the request gives (not
alphabetical by node name, so renaming a node changes nothing); a field with no
reducer takes the last value by default, and only strict mode makes differing
writes an error; equal writes never conflict (LangGraph rejects any two).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from alma_core import errors
from alma_core.joining import JoinPlanner, RunAtJoin, config_for, merge
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.schemas.events import BranchJoin, BranchJoinPayload
from alma_core.sequencing import BLAKE3, SHA256, Head, hash_scheme, state_hash


def head(seq: int, state: dict[str, Any]) -> Head:
    return Head(seq, state_hash(state), state)


def payload(**kw: Any) -> BranchJoinPayload:
    return BranchJoinPayload.model_validate({"join_id": "j", **kw}, strict=False)


MAIN = head(1, {"log": ["start"], "n": 10, "answer": "?"})
BRANCHES = {
    "alpha": head(2, {"log": ["a"], "n": 1, "answer": "A"}),
    "beta": head(3, {"log": ["b"], "n": 2, "answer": "B"}),
    "gamma": head(4, {"log": ["c"], "n": 3, "answer": "C"}),
}
REGISTRY = ReducerRegistry()


def run(p: BranchJoinPayload, branches: dict[str, Head] = BRANCHES) -> dict[str, Any]:
    return merge(
        p, main=MAIN, branches=branches, registered=None, registry=REGISTRY, max_state_bytes=10_000
    ).state


def test_order_is_the_requests_not_completion_or_name() -> None:
    reducers = {"log": "append", "n": "sum"}
    for order in itertools.permutations(BRANCHES):
        state = run(payload(branch_ids=list(order), reducers=reducers))
        assert state["log"] == ["start", *(BRANCHES[b].state["log"][0] for b in order)]
        assert state["n"] == 16
        assert state["answer"] == BRANCHES[order[-1]].state["answer"]  # last_value: last given


def test_renaming_a_branch_changes_nothing() -> None:
    """LangGraph orders by node name, so a rename can change the result; here it cannot."""
    renamed = {"zeta" if k == "alpha" else k: v for k, v in BRANCHES.items()}
    order = ["alpha", "beta", "gamma"]
    assert run(payload(branch_ids=order)) == run(
        payload(branch_ids=["zeta", "beta", "gamma"]), renamed
    )


def test_no_reducer_conflict_is_an_error_only_in_strict_mode() -> None:
    with pytest.raises(errors.ConflictingUpdate, match=r"field 'answer'.*alpha, beta"):
        run(
            payload(
                branch_ids=["alpha", "beta"], reducers={"log": "append", "n": "sum"}, strict=True
            )
        )
    assert run(payload(branch_ids=["alpha", "beta"]))["answer"] == "B"


def test_equal_writes_never_conflict() -> None:
    same = {"x": head(2, {"v": 1}), "y": head(3, {"v": 1})}
    assert run(payload(branch_ids=["x", "y"], strict=True), same)["v"] == 1


def test_missing_branch_names_it() -> None:
    with pytest.raises(errors.MissingBranch, match="'delta'"):
        run(payload(branch_ids=["alpha", "delta"]))


def test_merged_state_over_the_limit() -> None:
    big = {"x": head(2, {"blob": "x" * 600}), "y": head(3, {"more": "y" * 600})}
    with pytest.raises(errors.StateTooLarge, match="merged state"):
        merge(
            payload(branch_ids=["x", "y"]),
            main=None,
            branches=big,
            registered=None,
            registry=REGISTRY,
            max_state_bytes=1000,
        )


def test_request_reducers_override_the_workflows_field_by_field() -> None:
    registered = ReducerConfig({"log": "append", "n": "sum"}, strict=True)
    config = config_for(payload(branch_ids=["a"], reducers={"n": "max"}), registered)
    assert dict(config.field_reducers) == {"log": "append", "n": "max"}
    assert config.strict
    assert not config_for(payload(branch_ids=["a"], strict=False), registered).strict


def test_states_join_has_no_base_and_records_no_branches() -> None:
    p = payload(states=[{"n": 1}, {"n": 2}], reducers={"n": "sum"})
    result = merge(
        p, main=MAIN, branches={}, registered=None, registry=REGISTRY, max_state_bytes=1000
    )
    assert result.state == {"n": 3}
    assert result.merged_from == ()
    assert json.loads(result.state_json) == {"n": 3}


# --- the planner: a batch's joins in partition order --------------------------


def join_event(join_id: str, run: str = "r", tenant: str = "acme", **kw: Any) -> BranchJoin:
    doc = {
        "event_id": f"e-{join_id}",
        "type": "branch.join",
        "tenant_id": tenant,
        "emitted_at": "2026-11-23T10:00:00Z",
        "workflow_id": "wf",
        "run_id": run,
        "payload": {"join_id": join_id, **kw},
    }
    return BranchJoin.model_validate(doc, strict=False)


def planner(**kw: Any) -> JoinPlanner:
    runs = {("acme", "r"): RunAtJoin("acme", "wf", 4, {"": MAIN, **BRANCHES})}
    args: dict[str, Any] = {
        "runs": runs,
        "replies": {},
        "registered": {},
        "later_node": {},
        "registry": ReducerRegistry(),
        "max_state_bytes": 10_000,
    }
    return JoinPlanner(**(args | kw))


def test_a_merge_takes_the_next_seq_and_becomes_the_main_line() -> None:
    p = planner(registered={("acme", "wf"): ReducerConfig({"log": "append", "n": "sum"})})
    first = p.decide(join_event("j1", branch_ids=["alpha", "beta"]), 4)
    assert first.checkpoint is not None
    assert (first.checkpoint.seq, first.checkpoint.parent_seq) == (5, 1)
    assert first.reply["merged_state"] == {"log": ["start", "a", "b"], "n": 13, "answer": "B"}
    # a second join of the run in the same batch merges onto the first one's result
    second = p.decide(join_event("j2", branch_ids=["gamma"]), 5)
    assert second.checkpoint is not None
    assert (second.checkpoint.seq, second.checkpoint.parent_seq) == (6, 5)
    assert second.reply["merged_state"]["log"] == ["start", "a", "b", "c"]


def test_a_tenants_own_state_limit_holds_for_its_merges_alone() -> None:
    """A tenant's own limit below the global one refuses its merged state, saying whose
    limit it is; the same merge of a tenant without one is made."""
    big = [{"a": "x" * 600}, {"b": "y" * 600}]  # merged: ~1.2 KB, under the global 10 KB
    own = planner(state_limits={"acme": 1024})
    refused = own.decide(join_event("j", states=big), 4)
    assert refused.checkpoint is None
    assert isinstance(refused.rejection, errors.StateTooLarge)
    assert "the tenant's own limit is 1024" in refused.reply["error"]
    other = planner(state_limits={"globex": 1024})
    assert other.decide(join_event("j", states=big), 4).checkpoint is not None


def test_the_same_join_twice_is_one_merge_and_the_same_reply() -> None:
    p = planner()
    first = p.decide(join_event("j", branch_ids=["alpha"]), 4)
    again = p.decide(join_event("j", branch_ids=["beta"]), 4)  # redelivered, even altered
    assert again.duplicate
    assert again.checkpoint is None
    assert again.reply == first.reply
    earlier = planner(replies={("acme", "r", "old"): {"status": "ok", "note": "stored"}})
    assert earlier.decide(join_event("old", branch_ids=["alpha"]), 4).reply["note"] == "stored"


@pytest.mark.parametrize(
    ("kw", "tenant", "position", "reason"),
    [
        ({"branch_ids": ["alpha", "nope"]}, "acme", 4, "missing_branch"),
        ({"branch_ids": ["alpha"]}, "globex", 0, "missing_branch"),  # not this tenant's run
        ({"branch_ids": ["alpha"], "reducers": {"n": "nope"}}, "acme", 4, "unknown_reducer"),
        ({"branch_ids": ["alpha"]}, "acme", 2, "run_moved_past_join"),
    ],
)
def test_a_join_that_cannot_merge_answers_an_error_and_changes_nothing(
    kw: dict[str, Any], tenant: str, position: int, reason: str
) -> None:
    p = planner(later_node={("acme", "r", 2): 3})  # a node checkpoint at seq 3, after 2
    decision = p.decide(join_event("j", tenant=tenant, **kw), position)
    assert decision.checkpoint is None
    assert decision.rejection is not None
    assert decision.rejection.reason == reason
    assert decision.reply["status"] == "error"
    assert decision.reply["error"].startswith(reason)
    assert p.runs[("acme", "r")].last_seq == 4
    assert p.runs[("acme", "r")].heads[""] == MAIN


def test_a_hand_off_from_a_commit_the_run_no_longer_has_is_neither_merged_nor_answered() -> None:
    """A PostgreSQL failover lost the checkpointer's commit that brought the run to seq 6
    and handed the join off (asynchronous replication): the run is back at 4. Merging
    would merge branches the run no longer has, or answer an error that would then stand
    for the join; the checkpointer reads the join again and hands it off again."""
    p = planner()
    lost = p.decide(join_event("j", branch_ids=["alpha", "beta"]), 6)
    assert lost.lost
    assert (lost.checkpoint, lost.rejection, lost.duplicate) == (None, None, False)
    assert "status" not in lost.reply
    assert p.runs[("acme", "r")].last_seq == 4
    assert "j" not in {k[2] for k in p.replies}  # so the hand-off made again is merged
    again = p.decide(join_event("j", branch_ids=["alpha", "beta"]), 4)
    assert again.checkpoint is not None
    assert again.checkpoint.seq == 5
    # a run the database does not know at all: the lost commit was its first
    assert planner().decide(join_event("j", run="new", branch_ids=["alpha"]), 2).lost
    # a join answered before stays answered, whatever the hand-off's position
    answered = planner(replies={("acme", "r", "j"): {"status": "ok", "checkpoint_seq": 5}})
    assert answered.decide(join_event("j", branch_ids=["alpha"]), 9).duplicate


def test_a_join_consumes_the_branches_it_merges() -> None:
    p = planner()
    first = p.decide(join_event("j1", branch_ids=["alpha", "beta"]), 4)
    assert first.consumed == ("alpha", "beta")
    assert set(p.runs[("acme", "r")].heads) == {"", "gamma"}  # gamma was not merged: still a branch
    again = p.decide(join_event("j2", branch_ids=["alpha"]), 5)
    assert again.rejection is not None
    assert again.rejection.reason == "missing_branch"
    states = p.decide(join_event("j3", states=[{"x": 1}]), 5)
    assert states.consumed == ()  # merging given states consumes no branch


def test_a_pruned_run_answers_a_join_it_stored_and_refuses_any_other() -> None:
    stored = {"join_id": "j1", "status": "ok", "checkpoint_seq": 5}
    runs = {("acme", "r"): RunAtJoin("acme", "wf", 5, {"": MAIN, **BRANCHES}, pruned=True)}
    p = planner(runs=runs, replies={("acme", "r", "j1"): stored})
    again = p.decide(join_event("j1", branch_ids=["alpha"]), 4)
    assert again.duplicate
    assert again.reply == stored
    late = p.decide(join_event("j2", branch_ids=["alpha"]), 5)
    assert isinstance(late.rejection, errors.RunPruned)
    assert late.checkpoint is None
    assert late.reply["status"] == "error"
    assert late.reply["error"].startswith("run_pruned: ")


def test_a_merge_hashes_in_its_runs_scheme() -> None:
    """The merged state is hashed as the main line's head (a run stored before hash
    schemes keeps SHA-256), else as the branches', else with BLAKE3 (new runs)."""
    old = {k: Head(h.seq, state_hash(h.state, SHA256), h.state) for k, h in BRANCHES.items()}
    old_main = Head(1, state_hash(MAIN.state, SHA256), MAIN.state)
    p = payload(branch_ids=["alpha", "beta"])
    for main, branches, scheme in [
        (old_main, old, SHA256),
        (None, old, SHA256),
        (MAIN, BRANCHES, BLAKE3),
        (None, BRANCHES, BLAKE3),
    ]:
        merged = merge(
            p,
            main=main,
            branches=branches,
            registered=None,
            registry=REGISTRY,
            max_state_bytes=10_000,
        )
        assert merged.state_hash == state_hash(merged.state, scheme)
    states = payload(states=[{"n": 1}, {"n": 2}])
    merged = merge(
        states, main=None, branches={}, registered=None, registry=REGISTRY, max_state_bytes=100
    )
    assert hash_scheme(merged.state_hash) == BLAKE3
