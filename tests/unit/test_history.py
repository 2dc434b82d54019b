"""A run's past in pure code: diffs by path, a merge explained, a fork's identity."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from alma_core import history
from alma_core.reducers import ReducerConfig

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=12,
)


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _index(token: str) -> int:
    return int(token) if token.isascii() and token.isdigit() else 0


def patch(doc: Any, changes: list[history.Change]) -> Any:
    """Apply ``changes`` (removals of list items from the highest index down)."""
    if any(c.path == "" for c in changes):
        return copy.deepcopy(changes[-1].after)
    doc = copy.deepcopy(doc)
    ordered = [c for c in changes if c.kind != "removed"] + sorted(
        (c for c in changes if c.kind == "removed"),
        key=lambda c: (c.path.rsplit("/", 1)[0], _index(c.path.rsplit("/", 1)[1])),
        reverse=True,
    )
    for c in ordered:
        *parents, last = [_unescape(t) for t in c.path.split("/")[1:]]
        here = doc
        for token in parents:
            here = here[int(token)] if isinstance(here, list) else here[token]
        key: Any = int(last) if isinstance(here, list) else last
        if c.kind == "removed":
            del here[key]
        elif isinstance(here, list) and key == len(here):
            here.append(c.after)
        else:
            here[key] = c.after
    return doc


@given(JSON, JSON)
def test_a_diff_applied_to_the_first_gives_the_second(a: Any, b: Any) -> None:
    changes = history.diff(a, b)
    assert patch(a, changes) == b
    assert (changes == []) == (history.diff(b, a) == [])


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
        },
        {
            "field": "note",
            "reducer": "last_value",
            "before": None,
            "inputs": {"a@3": "a", "b@4": "b"},
            "result": "b",
        },
        {
            "field": "tags",
            "reducer": "append",
            "before": ["m"],
            "inputs": {"a@3": ["x"], "b@4": ["y"]},
            "result": ["m", "x", "y"],
        },
    ]


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
