"""A run's past in pure code: diffs by path, a merge explained, a fork's identity."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from hypothesis import given
from hypothesis import strategies as st

from alma_core import errors, history
from alma_core.reducers import ReducerConfig

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=12,
)


def patch(doc: Any, changes: list[history.Change]) -> Any:
    """Apply ``changes`` in the order given, as JSON Patch operations, by an independent
    implementation (the ``jsonpatch`` library): no reordering here."""
    return jsonpatch.apply_patch(doc, [c.to_operation() for c in changes])


@given(JSON, JSON)
def test_a_diff_applied_in_its_order_gives_the_second(a: Any, b: Any) -> None:
    changes = history.diff(a, b)
    assert patch(a, changes) == b
    assert (changes == []) == (history.diff(b, a) == [])


def test_a_lists_removals_come_from_its_end() -> None:
    """Applied lowest index first, removing 1 then 2 of a 3-item list fails: index 2 is
    gone once 1 is."""
    changes = history.diff({"l": ["a", "b", "c"]}, {"l": ["x"]})
    assert [c.to_operation() for c in changes] == [
        {"op": "replace", "path": "/l/0", "value": "x"},
        {"op": "remove", "path": "/l/2"},
        {"op": "remove", "path": "/l/1"},
    ]
    assert patch({"l": ["a", "b", "c"]}, changes) == {"l": ["x"]}
    grown = history.diff({"l": []}, {"l": [1, 2]})
    assert [c.path for c in grown] == ["/l/0", "/l/1"]


@given(JSON)
def test_a_value_has_no_difference_with_itself(a: Any) -> None:
    assert history.diff(a, copy.deepcopy(a)) == []


def test_paths_are_json_pointers_lists_by_index_and_types_count() -> None:
    before = {"plan": {"steps": ["a", "b"]}, "a/b": 1, "n": 1, "gone": True}
    after = {"plan": {"steps": ["a", "c", "d"]}, "a/b": 2, "n": True, "new": None}
    assert [c.to_doc() for c in history.diff(before, after)] == [
        {"path": "/a~1b", "kind": "changed", "before": 1, "after": 2},
        {"path": "/gone", "kind": "removed", "before": True},
        {"path": "/n", "kind": "changed", "before": 1, "after": True},  # 1 == True in Python
        {"path": "/new", "kind": "added", "after": None},
        {"path": "/plan/steps/1", "kind": "changed", "before": "b", "after": "c"},
        {"path": "/plan/steps/2", "kind": "added", "after": "d"},
    ]


def test_a_merge_is_explained_field_by_field_with_its_reducer() -> None:
    config = ReducerConfig(field_reducers={"n": "sum", "tags": "append"})
    fields = history.explain_merge(
        {"n": 6, "tags": ["m", "x", "y"], "note": "b"},
        {"n": 1, "tags": ["m"]},
        [{"n": 2, "tags": ["x"], "note": "a"}, {"n": 3, "tags": ["y"], "note": "b"}],
        config,
    )
    assert [f.to_doc(["a@3", "b@4"]) for f in fields] == [
        {
            "field": "n",
            "reducer": "sum",
            "before": 1,
            "inputs": {"a@3": 2, "b@4": 3},
            "result": 6,
            "absent": [],
        },
        {
            "field": "note",
            "reducer": "last_value",
            "inputs": {"a@3": "a", "b@4": "b"},
            "result": "b",
            "absent": ["before"],
        },
        {
            "field": "tags",
            "reducer": "append",
            "before": ["m"],
            "inputs": {"a@3": ["x"], "b@4": ["y"]},
            "result": ["m", "x", "y"],
            "absent": [],
        },
    ]


def test_a_null_is_told_apart_from_an_absent_field() -> None:
    """``null`` under ``last_value`` overwrites; an absent field does not: the merge
    explained, the diff and their JSON say which is which."""
    fields = history.explain_merge(
        {"a": None, "b": 1},
        {"a": 1, "b": 1},
        [{"a": None}, {}],
        ReducerConfig(),
    )
    a, b = (f.to_doc(["x@2", "y@3"]) for f in fields)
    assert a == {
        "field": "a",
        "reducer": "last_value",
        "before": 1,
        "inputs": {"x@2": None},
        "result": None,
        "absent": ["y@3"],
    }
    assert b["absent"] == ["x@2", "y@3"]
    assert fields[0].inputs == (None, history.ABSENT)
    changes = history.diff({"gone": 1, "nulled": 1}, {"nulled": None, "new": None})
    assert [(c.path, c.kind, c.before, c.after) for c in changes] == [
        ("/gone", "removed", 1, history.ABSENT),
        ("/new", "added", history.ABSENT, None),
        ("/nulled", "changed", 1, None),
    ]
    assert [c.to_doc() for c in changes][1:] == [
        {"path": "/new", "kind": "added", "after": None},
        {"path": "/nulled", "kind": "changed", "before": 1, "after": None},
    ]


def test_the_inspector_shows_absent_beside_null() -> None:
    from alma_core.ui.rendering import environment

    changes = history.diff({"gone": 1, "nulled": 1}, {"nulled": None})
    html = environment().get_template("changes.html").render(changes=changes)
    rows = html.split("<tr class=")[1:]
    assert 'class="absent">absent</em>' in rows[0]  # /gone: nothing after
    assert "absent" not in rows[1]  # /nulled: null after
    assert "<pre>null</pre>" in rows[1]


def test_a_fork_asked_again_is_the_same_event_and_each_fork_its_own() -> None:
    one = history.fork_event_id("acme", "r-1", 3, "r-2")
    assert one == history.fork_event_id("acme", "r-1", 3, "r-2")
    others = {
        history.fork_event_id("globex", "r-1", 3, "r-2"),
        history.fork_event_id("acme", "r-1", 4, "r-2"),
        history.fork_event_id("acme", "r-1", 3, "r-3"),
        history.fork_event_id("acme", "r-13", 3, "-r-2"),
    }
    assert one not in others
    assert len(others) == 4
    assert len(one) <= 256


def test_a_cut_value_says_so() -> None:
    from alma_core.ui.rendering import environment

    changes = history.diff({"long": "a"}, {"long": "b" * 5000})
    html = environment().get_template("changes.html").render(changes=changes)
    assert "more characters not shown (of 5002)" in html
    assert "b" * 5000 not in html


def test_a_pointer_finds_what_a_diff_names() -> None:
    doc = {"a/b": {"~x": [10, {"y": None}]}, "": 1}
    for change in history.diff({}, doc):
        assert history.at_pointer(doc, change.path) == change.after
    assert history.at_pointer(doc, "/a~1b/~0x/1/y") is None
    assert history.at_pointer(doc, "") == doc
    for missing in ("/nope", "/a~1b/~0x/2", "/a~1b/~0x/-1", "no-slash"):
        with pytest.raises(KeyError):
            history.at_pointer(doc, missing)


def test_a_lone_surrogate_is_found_by_its_pointer() -> None:
    assert history.lone_surrogate({"a": ["x", {"b/c": "y\udc00"}]}) == "/a/1/b~1c"
    assert history.lone_surrogate({"k\ud800": 1}) == "/k\ud800"
    assert history.lone_surrogate({"a": ["x", "\U0001f600"], "n": 1.5}) is None


def test_a_forks_edit_is_a_json_patch_applied_to_a_copy_or_refused() -> None:
    state = {"plan": ["a", "b"], "n": 1}
    edited = history.patched(
        state,
        [
            {"op": "replace", "path": "/n", "value": 2},
            {"op": "add", "path": "/plan/-", "value": "c"},
            {"op": "test", "path": "/plan/0", "value": "a"},
        ],
    )
    assert edited == {"plan": ["a", "b", "c"], "n": 2}
    assert state == {"plan": ["a", "b"], "n": 1}  # untouched
    for bad, says in (
        ({"op": "add", "path": "/x", "value": 1}, "a list of operations"),
        (["replace /n"], "a list of operations"),
        ([{"op": "remove", "path": "/missing"}], "does not apply"),
        ([{"op": "test", "path": "/n", "value": 5}], "does not apply"),
        ([{"op": "frobnicate", "path": "/n"}], "does not apply"),
        ([{"op": "add", "path": "/x"}], "does not apply"),  # no value
        ([{"op": "replace", "path": "", "value": "text"}], "a state is an object"),
    ):
        with pytest.raises(errors.InvalidPatch, match=says):
            history.patched(state, bad)


def test_a_fork_with_an_edit_is_another_event_than_without_or_with_another() -> None:
    plain = history.fork_event_id("t", "r", 3, "new")
    edit = {"patch": [{"op": "remove", "path": "/n"}], "note": "why"}
    assert history.fork_event_id("t", "r", 3, "new", edit) == history.fork_event_id(
        "t", "r", 3, "new", dict(reversed(list(edit.items())))
    )
    assert (
        len(
            {
                plain,
                history.fork_event_id("t", "r", 3, "new", edit),
                history.fork_event_id("t", "r", 3, "new", edit | {"note": "other"}),
            }
        )
        == 3
    )
    assert history.fork_event_id("t", "r", 3, "new", {}) == plain
