"""Reducers: semantics, determinism, identity, associativity, and clear errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alma_core import errors
from alma_core.reducers import (
    BUILTINS,
    Reducer,
    ReducerConfig,
    ReducerRegistry,
    apply_updates,
    fold_field,
    merge_states,
)

json_scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)
states = st.dictionaries(st.sampled_from("abcde"), json_values, max_size=5)

VALUES_FOR: dict[str, st.SearchStrategy[Any]] = {
    "last_value": json_values,
    "first_value": json_values,
    "append": json_values,
    "merge_dict": st.dictionaries(st.text(max_size=3), json_values, max_size=4),
    "deep_merge": st.dictionaries(st.text(max_size=3), json_values, max_size=4),
    "sum": st.integers(-(10**9), 10**9),
    "max": st.integers(-(10**9), 10**9),
    "min": st.integers(-(10**9), 10**9),
    "union": st.lists(json_values, max_size=5),
}


def test_builtin_names() -> None:
    assert {r.name for r in BUILTINS} == set(VALUES_FOR)


@pytest.mark.parametrize(
    ("reducer", "values", "expected"),
    [
        ("last_value", [1, 2, None], None),
        ("first_value", [None, 2, 3], None),
        ("append", [[1], [2, 3], 4], [1, 2, 3, 4]),
        ("append", [[1], None, [2]], [1, 2]),
        ("merge_dict", [{"a": 1, "b": 1}, {"b": 2}], {"a": 1, "b": 2}),
        ("deep_merge", [{"a": {"x": 1, "y": 1}}, {"a": {"y": 2}}], {"a": {"x": 1, "y": 2}}),
        ("sum", [1, 2.5, None, 3], 6.5),
        ("max", [3, 9, 4], 9),
        ("min", [3, -9, 4], -9),
        ("max", ["b", "c", "a"], "c"),
        ("union", [[1, 2], [2, 3], [{"k": 1}], [{"k": 1}]], [1, 2, 3, {"k": 1}]),
    ],
)
def test_semantics(reducer: str, values: list[Any], expected: Any) -> None:
    config = ReducerConfig(field_reducers={"f": reducer})
    assert fold_field("f", values, config) == expected


def test_merge_applies_states_in_given_order() -> None:
    config = ReducerConfig(field_reducers={"log": "append"})
    a, b = {"log": ["a"], "x": 1}, {"log": ["b"], "x": 2}
    assert merge_states([a, b], config) == {"log": ["a", "b"], "x": 2}
    assert merge_states([b, a], config) == {"log": ["b", "a"], "x": 1}


def test_missing_key_does_not_take_part() -> None:
    merged = merge_states([{"n": 1}, {}, {"n": 2}], ReducerConfig(field_reducers={"n": "sum"}))
    assert merged == {"n": 3}


@given(st.lists(states, min_size=1, max_size=5))
def test_merge_is_deterministic(batch: list[dict[str, Any]]) -> None:
    assert merge_states(batch) == merge_states([dict(s) for s in batch])


@given(states)
def test_identity_on_one_state(state: dict[str, Any]) -> None:
    assert merge_states([state]) == state


@pytest.mark.parametrize("name", [r.name for r in BUILTINS if r.associative])
@given(data=st.data())
def test_associative_reducers_are_associative(name: str, data: st.DataObject) -> None:
    a, b, c = (data.draw(VALUES_FOR[name]) for _ in range(3))
    config = ReducerConfig(field_reducers={"f": name})
    left = fold_field("f", [fold_field("f", [a, b], config), c], config)
    right = fold_field("f", [a, fold_field("f", [b, c], config)], config)
    assert left == right


@pytest.mark.parametrize("name", [r.name for r in BUILTINS if r.fold_many is not None])
@given(data=st.data())
def test_one_pass_folds_give_what_the_pairwise_fold_gives(name: str, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.none() | VALUES_FOR[name], min_size=1, max_size=7))
    reducer = ReducerRegistry().get(name)
    pairwise = values[0]
    for value in values[1:]:
        if value is None:
            continue
        pairwise = value if pairwise is None else reducer.combine(pairwise, value)
    folded = fold_field("f", values, ReducerConfig(field_reducers={"f": name}))
    assert folded == pairwise
    if isinstance(folded, dict):  # keys in the order they first appeared, as pairwise
        assert list(folded) == list(pairwise)


@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=10))
def test_updates_fold_like_a_merge(increments: list[int]) -> None:
    config = ReducerConfig(field_reducers={"n": "sum", "log": "append"})
    state: dict[str, Any] = {}
    for i in increments:
        state = apply_updates(state, {"n": i, "log": [i]}, config)
    assert state == {"n": sum(increments), "log": increments}


def test_updates_default_overwrites_key_by_key() -> None:
    assert apply_updates({"a": 1, "b": 2}, {"b": 3, "c": None}) == {"a": 1, "b": 3, "c": None}


def test_sum_over_a_string_names_the_field() -> None:
    config = ReducerConfig(field_reducers={"total": "sum"})
    with pytest.raises(errors.ReducerTypeError, match=r"field 'total'.*'sum' expects a number"):
        merge_states([{"total": "abc"}], config)


def test_update_onto_wrong_type_is_a_type_error() -> None:
    config = ReducerConfig(field_reducers={"total": "sum"})
    with pytest.raises(errors.ReducerTypeError, match="field 'total'"):
        apply_updates({"total": "x"}, {"total": 1}, config)


def test_max_refuses_mixed_kinds() -> None:
    with pytest.raises(errors.ReducerTypeError, match="cannot compare"):
        fold_field("m", [1, "a"], ReducerConfig(field_reducers={"m": "max"}))


def test_bool_is_not_a_number() -> None:
    with pytest.raises(errors.ReducerTypeError):
        fold_field("n", [True, 1], ReducerConfig(field_reducers={"n": "sum"}))


def test_unknown_reducer_names_field_and_known_ones() -> None:
    config = ReducerConfig(field_reducers={"score": "median"})
    with pytest.raises(
        errors.UnknownReducer, match=r"'median' \(field 'score'\).*known reducers: append"
    ):
        merge_states([{"score": 1}], config)


def test_unknown_default_reducer() -> None:
    with pytest.raises(errors.UnknownReducer, match="default_reducer"):
        merge_states([{}], ReducerConfig(default_reducer="nope"))


def test_strict_conflict_names_the_field() -> None:
    config = ReducerConfig(field_reducers={"log": "append"}, strict=True)
    with pytest.raises(errors.ConflictingUpdate, match="field 'answer'"):
        merge_states([{"answer": 1, "log": [1]}, {"answer": 2, "log": [2]}], config)


def test_strict_allows_equal_values_and_reducer_fields() -> None:
    config = ReducerConfig(field_reducers={"log": "append"}, strict=True)
    merged = merge_states([{"a": 1, "log": [1]}, {"a": 1, "log": [2]}], config)
    assert merged == {"a": 1, "log": [1, 2]}


def test_registry_extension_by_name() -> None:
    registry = ReducerRegistry()
    registry.register("concat", lambda c, u: f"{c}{u}", accepts=lambda v: isinstance(v, str))
    config = ReducerConfig(field_reducers={"s": "concat"})
    assert merge_states([{"s": "a"}, {"s": "b"}], config, registry) == {"s": "ab"}
    with pytest.raises(errors.ReducerTypeError, match="field 's'"):
        merge_states([{"s": "a"}, {"s": 1}], config, registry)


def test_registry_accepts_reducer_objects_and_rejects_bad_names() -> None:
    registry = ReducerRegistry()
    registry.register("longest", Reducer("x", lambda c, u: u if len(u) > len(c) else c))
    assert registry.get("longest").name == "longest"
    with pytest.raises(errors.ConfigError):
        registry.register("bad name!", lambda c, u: u)


def test_custom_reducer_failure_becomes_reducer_error() -> None:
    registry = ReducerRegistry()
    registry.register("divide", lambda c, u: c / u)
    config = ReducerConfig(field_reducers={"q": "divide"})
    with pytest.raises(errors.ReducerTypeError, match="field 'q'"):
        merge_states([{"q": 1}, {"q": 0}], config, registry)


def test_config_round_trips_json() -> None:
    config = ReducerConfig(field_reducers={"a": "sum"}, default_reducer="first_value", strict=True)
    assert ReducerConfig.from_json(config.to_json()) == config


def test_deep_merge_is_not_associative_and_says_so() -> None:
    config = ReducerConfig(field_reducers={"f": "deep_merge"})
    a, b, c = {"k": {"x": 1}}, {"k": None}, {"k": {}}
    left = fold_field("f", [fold_field("f", [a, b], config), c], config)
    right = fold_field("f", [a, fold_field("f", [b, c], config)], config)
    assert left != right
    assert not ReducerRegistry().get("deep_merge").associative
