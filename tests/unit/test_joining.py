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
from alma_core.joining import config_for, merge
from alma_core.reducers import ReducerConfig, ReducerRegistry
from alma_core.sequencing import Head, state_hash
from schemas.events import BranchJoinPayload


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
    return merge(p, main=MAIN, branches=branches, registered=None, registry=REGISTRY,
                 max_state_bytes=10_000).state  # fmt: skip


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
        run(payload(branch_ids=["alpha", "beta"], reducers={"log": "append", "n": "sum"},
                    strict=True))  # fmt: skip
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
        merge(payload(branch_ids=["x", "y"]), main=None, branches=big, registered=None,
              registry=REGISTRY, max_state_bytes=1000)  # fmt: skip


def test_request_reducers_override_the_workflows_field_by_field() -> None:
    registered = ReducerConfig({"log": "append", "n": "sum"}, strict=True)
    config = config_for(payload(branch_ids=["a"], reducers={"n": "max"}), registered)
    assert dict(config.field_reducers) == {"log": "append", "n": "max"}
    assert config.strict
    assert not config_for(payload(branch_ids=["a"], strict=False), registered).strict


def test_states_join_has_no_base_and_records_no_branches() -> None:
    p = payload(states=[{"n": 1}, {"n": 2}], reducers={"n": "sum"})
    result = merge(p, main=MAIN, branches={}, registered=None, registry=REGISTRY,
                   max_state_bytes=1000)  # fmt: skip
    assert result.state == {"n": 3}
    assert result.merged_from == ()
    assert json.loads(result.state_json) == {"n": 3}
