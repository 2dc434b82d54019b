"""Reducers: how values written to one state field combine.

A reducer is a binary function ``combine(current, update) -> new``. The same
reducer serves both uses:

* ``apply_updates(state, updates, config)``: a ``node.completed`` with
  ``updates`` folds each update into the run's (or branch's) current state;
* ``merge_states(states, config)``: a ``branch.join`` folds the branch states
  left to right, in the order given (never by completion time or name).

A field missing from a state does not take part in the fold. ``None`` is a
real value for ``last_value`` and ``first_value`` (an explicit null overwrites,
as JSONB ``||`` does) and "nothing" for every other reducer.

Pure code: no I/O, no asyncio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from alma_core import errors
from alma_core.schemas import jsoncodec

ENTRY_POINT_GROUP = "alma.reducers"

CombineFn = Callable[[Any, Any], Any]
CheckFn = Callable[[Any], bool]


@dataclass(frozen=True)
class Reducer:
    """A named binary reducer.

    ``accepts`` says which values the reducer takes (checked on every value,
    the first one included, so ``sum`` over a string fails even alone);
    ``associative`` is a promise the property tests hold the reducer to;
    ``fold_many``, where given, folds two or more values (no ``None`` among them) in
    one pass and must give what the pairwise fold gives (a property test holds it to
    that): ``append`` and ``merge_dict`` folded pairwise copy the growing result once
    per branch.
    """

    name: str
    combine: CombineFn
    accepts: CheckFn = lambda _value: True
    expects: str = "any JSON value"
    associative: bool = False
    skips_none: bool = True
    fold_many: Callable[[Sequence[Any]], Any] | None = None


def _is_number(value: Any) -> bool:
    kind = type(value)
    if kind is int:  # the common cases first: a merge checks every value it folds
        return True
    if kind is float:
        return math.isfinite(value)
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and not (isinstance(value, float) and not math.isfinite(value))
    )


def _is_orderable(value: Any) -> bool:
    return _is_number(value) or isinstance(value, str)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _append(current: Any, update: Any) -> list[Any]:
    return _as_list(current) + _as_list(update)


def _append_all(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if isinstance(value, list):
            out.extend(value)
        else:
            out.append(value)
    return out


def _merge_all(values: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for value in values:
        out.update(value)
    return out


def _canonical(value: Any) -> str:
    return jsoncodec.canonical(value).decode()


def _union(current: list[Any], update: list[Any]) -> list[Any]:
    seen: set[str] = set()
    out: list[Any] = []
    for item in [*current, *update]:
        key = _canonical(item)
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def _deep_merge(current: Any, update: Any) -> Any:
    if isinstance(current, dict) and isinstance(update, dict):
        out = dict(current)
        for key, value in update.items():
            out[key] = _deep_merge(out[key], value) if key in out else value
        return out
    return update


def _max(current: Any, update: Any) -> Any:
    _same_kind("max", current, update)
    return update if update > current else current


def _min(current: Any, update: Any) -> Any:
    _same_kind("min", current, update)
    return update if update < current else current


def _same_kind(name: str, a: Any, b: Any) -> None:
    if isinstance(a, str) != isinstance(b, str):
        raise errors.ReducerTypeError(
            f"reducer {name!r} cannot compare {type(a).__name__} with {type(b).__name__}"
        )


BUILTINS: tuple[Reducer, ...] = (
    Reducer("last_value", lambda _c, u: u, associative=True, skips_none=False),
    Reducer("first_value", lambda c, _u: c, associative=True, skips_none=False),
    Reducer(
        "append",
        _append,
        associative=True,
        expects="a list or a single item",
        fold_many=_append_all,
    ),
    Reducer(
        "merge_dict",
        lambda c, u: {**c, **u},
        accepts=lambda v: isinstance(v, dict),
        expects="an object",
        associative=True,
        fold_many=_merge_all,
    ),
    Reducer(
        "deep_merge",
        _deep_merge,
        accepts=lambda v: isinstance(v, dict),
        expects="an object",
        # Not associative: a non-object value replaces a nested object whole, so
        # ({k: {..}} + {k: 1}) + {k: {}} differs from {k: {..}} + ({k: 1} + {k: {}}).
        associative=False,
    ),
    Reducer("sum", lambda c, u: c + u, accepts=_is_number, expects="a number", associative=True),
    Reducer("max", _max, accepts=_is_orderable, expects="a number or a string", associative=True),
    Reducer("min", _min, accepts=_is_orderable, expects="a number or a string", associative=True),
    Reducer(
        "union",
        _union,
        accepts=lambda v: isinstance(v, list),
        expects="a list",
        associative=True,
    ),
)


class ReducerRegistry:
    """Reducers by name. Applications add their own with :meth:`register` or
    through the ``alma.reducers`` entry-point group (a callable
    ``(current, update) -> new`` or a :class:`Reducer`)."""

    def __init__(self, reducers: Iterable[Reducer] = BUILTINS) -> None:
        self._reducers: dict[str, Reducer] = {r.name: r for r in reducers}

    def register(
        self,
        name: str,
        combine: CombineFn | Reducer,
        *,
        accepts: CheckFn | None = None,
        associative: bool = False,
    ) -> Reducer:
        if not name or not name.replace("_", "").replace(".", "").isalnum():
            raise errors.ConfigError(f"reducer name {name!r} must be letters, digits, '_' or '.'")
        if isinstance(combine, Reducer):
            reducer = combine if combine.name == name else _renamed(combine, name)
        else:
            reducer = Reducer(
                name, combine, accepts=accepts or (lambda _v: True), associative=associative
            )
        self._reducers[name] = reducer
        return reducer

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> list[str]:
        """Register every reducer advertised in ``group``; returns their names."""
        loaded = []
        for ep in metadata.entry_points(group=group):
            target = ep.load()
            if not (isinstance(target, Reducer) or callable(target)):
                raise errors.ConfigError(
                    f"entry point {ep.name!r} in {group!r} is {type(target).__name__}, "
                    "expected a callable (current, update) -> new or an alma_core.reducers.Reducer"
                )
            self.register(ep.name, target)
            loaded.append(ep.name)
        return loaded

    def get(self, name: str) -> Reducer:
        try:
            return self._reducers[name]
        except KeyError:
            raise errors.UnknownReducer(
                f"unknown reducer {name!r}; known reducers: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._reducers)

    def __contains__(self, name: object) -> bool:
        return name in self._reducers


def _renamed(reducer: Reducer, name: str) -> Reducer:
    return Reducer(
        name,
        reducer.combine,
        accepts=reducer.accepts,
        expects=reducer.expects,
        associative=reducer.associative,
        skips_none=reducer.skips_none,
        fold_many=reducer.fold_many,
    )


_default_registry: ReducerRegistry | None = None


def default_registry() -> ReducerRegistry:
    """The process-wide registry: built-ins plus the ``alma.reducers`` entry points."""
    global _default_registry
    if _default_registry is None:
        registry = ReducerRegistry()
        registry.load_entry_points()
        _default_registry = registry
    return _default_registry


@dataclass(frozen=True)
class ReducerConfig:
    """Which reducer each field uses; fields not named use ``default_reducer``.

    ``strict``: a field with no reducer of its own that receives two different
    values is an error naming the field (rather than the last one winning).
    Equal values never conflict.
    """

    field_reducers: Mapping[str, str] = field(default_factory=dict)
    default_reducer: str = "last_value"
    strict: bool = False

    def validate(self, registry: ReducerRegistry | None = None) -> None:
        """Raise :class:`errors.UnknownReducer` naming the field with an unknown reducer."""
        registry = registry or default_registry()
        for name in [self.default_reducer, *self.field_reducers.values()]:
            if name not in registry:
                where = [f for f, r in self.field_reducers.items() if r == name]
                field_note = f" (field {where[0]!r})" if where else " (default_reducer)"
                raise errors.UnknownReducer(
                    f"unknown reducer {name!r}{field_note}; known reducers: "
                    f"{', '.join(registry.names())}"
                )

    def reducer_for(self, key: str, registry: ReducerRegistry) -> Reducer:
        return registry.get(self.field_reducers.get(key, self.default_reducer))

    def to_json(self) -> dict[str, Any]:
        return {
            "reducers": dict(self.field_reducers),
            "default_reducer": self.default_reducer,
            "strict": self.strict,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReducerConfig:
        return cls(
            field_reducers=dict(data.get("reducers") or {}),
            default_reducer=data.get("default_reducer") or "last_value",
            strict=bool(data.get("strict", False)),
        )


def _check(reducer: Reducer, key: str, value: Any) -> None:
    if value is None and reducer.skips_none:
        return
    if not reducer.accepts(value):
        raise errors.ReducerTypeError(
            f"field {key!r}: reducer {reducer.name!r} expects {reducer.expects}, "
            f"got {type(value).__name__} {_preview(value)}"
        )


def _preview(value: Any) -> str:
    text = _canonical(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _combine(reducer: Reducer, key: str, current: Any, update: Any) -> Any:
    if reducer.skips_none:
        if update is None:
            return current
        if current is None:
            return update
    try:
        return reducer.combine(current, update)
    except errors.AlmaError as exc:
        raise type(exc)(f"field {key!r}: {exc.message}") from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise errors.ReducerTypeError(
            f"field {key!r}: reducer {reducer.name!r} failed on "
            f"{_preview(current)} and {_preview(update)}: {exc}"
        ) from exc


def fold_field(
    key: str,
    values: Sequence[Any],
    config: ReducerConfig,
    registry: ReducerRegistry | None = None,
) -> Any:
    """Fold the values one field received, left to right."""
    registry = registry or default_registry()
    reducer = config.reducer_for(key, registry)
    accepts, skips_none = reducer.accepts, reducer.skips_none
    for value in values:
        if not (value is None and skips_none) and not accepts(value):
            _check(reducer, key, value)  # raises, naming the field
    if config.strict and key not in config.field_reducers:
        distinct = {_canonical(v) for v in values}
        if len(distinct) > 1:
            raise errors.ConflictingUpdate(
                f"field {key!r} received {len(distinct)} different values and has no reducer "
                f"(strict mode); give it a reducer or turn strict off"
            )
    if reducer.fold_many is not None and reducer.skips_none and len(values) > 2:
        present = [v for v in values if v is not None]
        if len(present) > 1:
            return reducer.fold_many(present)
    acc = values[0]
    for value in values[1:]:
        acc = _combine(reducer, key, acc, value)
    return acc


def merge_states(
    states: Sequence[Mapping[str, Any]],
    config: ReducerConfig | None = None,
    registry: ReducerRegistry | None = None,
    *,
    validated: bool = False,
) -> dict[str, Any]:
    """Merge states in the order given. Keys keep the order of first appearance.
    ``validated``: the caller validated ``config`` against ``registry`` already."""
    config = config or ReducerConfig()
    registry = registry or default_registry()
    if not validated:
        config.validate(registry)
    columns: dict[str, list[Any]] = {}
    for state in states:
        for key, value in state.items():
            column = columns.get(key)
            if column is None:
                columns[key] = [value]
            else:
                column.append(value)
    return {key: fold_field(key, values, config, registry) for key, values in columns.items()}


def apply_updates(
    current: Mapping[str, Any],
    updates: Mapping[str, Any],
    config: ReducerConfig | None = None,
    registry: ReducerRegistry | None = None,
    *,
    validated: bool = False,
) -> dict[str, Any]:
    """Fold semantic-key updates into a state; untouched keys are kept as they are.
    ``validated``: the caller validated ``config`` against ``registry`` already.

    Strict mode does not apply here: an update to a field is meant to change it.
    """
    config = config or ReducerConfig()
    registry = registry or default_registry()
    if not validated:
        config.validate(registry)
    out = dict(current)
    for key, value in updates.items():
        reducer = config.reducer_for(key, registry)
        accepts, skips_none = reducer.accepts, reducer.skips_none
        if not (value is None and skips_none) and not accepts(value):
            _check(reducer, key, value)  # raises, naming the field
        if key in out:
            held = out[key]
            if not (held is None and skips_none) and not accepts(held):
                _check(reducer, key, held)
            out[key] = _combine(reducer, key, held, value)
        else:
            out[key] = value
    return out
