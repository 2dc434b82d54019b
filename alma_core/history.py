"""A run's past, in pure code: what changed between two states, a merge explained field
by field, and the identity of a fork.

* :func:`diff` compares two JSON values by path: keys added, removed and changed, lists
  by index (an item inserted at the front shows as every later index changed, plus
  one added at the end: positions are what a reducer such as ``append`` works on).
  Paths are JSON Pointers (RFC 6901: ``/plan/steps/2``, ``~1`` for ``/`` in a key).
  A value that changes type (``1`` to ``"1"``, ``1`` to ``true``) is changed even
  where Python calls them equal. The changes apply one after another in the order
  given, as JSON Patch operations (RFC 6902: ``changed`` is ``replace``, ``added`` is
  ``add``, ``removed`` is ``remove``; :meth:`Change.to_operation`): within a list, its
  kept items' changes come first, then the items removed from the last index down, then
  those added from the first up.
* :func:`explain_merge` lays a merged checkpoint beside its inputs: for each field,
  the reducer that folded it, the main line's value before, each input's value and
  the result.
* :func:`fork_event_id` names the event that starts a fork: the same source run, seq
  and new run (and edit) give the same id, so a fork asked twice (a retry, a
  re-delivery) is one fork; :func:`patched` applies a fork's edit, a JSON Patch, to
  the state it starts from, refusing one that does not apply.
"""

from __future__ import annotations

import enum
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import jsonpatch
import jsonpointer

from alma_core import errors
from alma_core.reducers import ReducerConfig

ChangeKind = Literal["added", "removed", "changed"]


class Absent(enum.Enum):
    """A field a state does not have, told apart from one that holds ``null``
    (``null`` under ``last_value`` overwrites; an absent field does not)."""

    ABSENT = "absent"

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Final = Absent.ABSENT
_FORKS = uuid.UUID("6f1d3c1e-5a0b-4c55-9f43-2f7c9e1b8a10")  # namespace of fork event ids


@dataclass(frozen=True)
class Change:
    """One difference: where (a JSON Pointer), what kind, the values on each side."""

    path: str
    kind: ChangeKind
    before: Any = ABSENT  # ABSENT where added
    after: Any = ABSENT  # ABSENT where removed

    def to_operation(self) -> dict[str, Any]:
        """This change as a JSON Patch (RFC 6902) operation; a diff's operations, in
        its order, turn the state before into the state after."""
        if self.kind == "removed":
            return {"op": "remove", "path": self.path}
        op = "add" if self.kind == "added" else "replace"
        return {"op": op, "path": self.path, "value": self.after}

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "kind": self.kind}
        if self.kind != "added":
            doc["before"] = self.before
        if self.kind != "removed":
            doc["after"] = self.after
        return doc


def at_pointer(doc: Any, path: str) -> Any:
    """The value at the RFC 6901 pointer ``path`` (``""``: the whole); KeyError naming
    the first step that is not there."""
    if path == "":
        return doc
    if not path.startswith("/"):
        raise KeyError(f"a JSON Pointer starts with '/': {path!r}")
    here = doc
    for raw in path[1:].split("/"):
        step = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(here, Mapping) and step in here:
            here = here[step]
        elif isinstance(here, list) and step.isdigit() and int(step) < len(here):
            here = here[int(step)]
        else:
            raise KeyError(f"nothing at {step!r} of {path!r}")
    return here


def pointer(parent: str, key: str | int) -> str:
    """``parent`` extended by one key or index, escaped as RFC 6901 says."""
    return f"{parent}/{str(key).replace('~', '~0').replace('/', '~1')}"


_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The JSON Pointer of the first string (value or key) in ``value`` holding a lone
    surrogate (``"\\ud800"``: no UTF-8, so no JSON on the wire, can carry it); None
    when there is none."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            here = pointer(path, key)
            found = here if isinstance(key, str) and _SURROGATE.search(key) else None
            found = found or lone_surrogate(item, here)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = lone_surrogate(item, pointer(path, i))
            if found is not None:
                return found
    return None


def _same(a: Any, b: Any) -> bool:
    """The same JSON value: of one type (``1`` is not ``1.0`` nor ``true``) and equal,
    floats by their sign too (``-0.0`` is not ``0.0``, though Python says equal)."""
    if type(a) is not type(b) or a != b:
        return False
    return not isinstance(a, float) or math.copysign(1.0, a) == math.copysign(1.0, b)


def diff(before: Any, after: Any, path: str = "") -> list[Change]:
    """Every difference from ``before`` to ``after``, keys sorted, in an order that
    applies one change after another (a list's removals from its end)."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        changes: list[Change] = []
        for key in sorted(set(before) | set(after), key=str):
            here = pointer(path, key)
            if key not in after:
                changes.append(Change(here, "removed", before=before[key]))
            elif key not in before:
                changes.append(Change(here, "added", after=after[key]))
            else:
                changes += diff(before[key], after[key], here)
        return changes
    if isinstance(before, list) and isinstance(after, list):
        kept = min(len(before), len(after))
        changes = []
        for i in range(kept):
            changes += diff(before[i], after[i], pointer(path, i))
        # removed from the end down, so each index still names its item when applied
        for i in reversed(range(kept, len(before))):
            changes.append(Change(pointer(path, i), "removed", before=before[i]))
        for i in range(kept, len(after)):
            changes.append(Change(pointer(path, i), "added", after=after[i]))
        return changes
    return [] if _same(before, after) else [Change(path, "changed", before, after)]


@dataclass(frozen=True)
class FieldMerge:
    """How one field of a merged state came to be; ``ABSENT`` where a side has no
    such field (``None`` is a field set to ``null``)."""

    field: str
    reducer: str
    before: Any  # the main line's value before the merge
    inputs: tuple[Any, ...]  # each input's value, in the merge's order
    result: Any

    def to_doc(self, labels: Sequence[str]) -> dict[str, Any]:
        """As JSON: a side without the field has no entry (``before``, an input's label,
        ``result``) and is named in ``absent``; ``null`` is a field set to null."""
        sides = {"before": self.before, **dict(zip(labels, self.inputs, strict=True))}
        sides["result"] = self.result
        doc: dict[str, Any] = {"field": self.field, "reducer": self.reducer}
        if self.before is not ABSENT:
            doc["before"] = self.before
        doc["inputs"] = {
            label: v for label, v in zip(labels, self.inputs, strict=True) if v is not ABSENT
        }
        if self.result is not ABSENT:
            doc["result"] = self.result
        doc["absent"] = [side for side, v in sides.items() if v is ABSENT]
        return doc


def explain_merge(
    result: Mapping[str, Any],
    before: Mapping[str, Any] | None,
    inputs: Sequence[Mapping[str, Any]],
    config: ReducerConfig,
) -> list[FieldMerge]:
    """Each field the merge touched or kept (sorted): its reducer, the main line's value
    before, every input's, and the merged one."""
    base = before or {}
    fields = sorted(set(result) | set(base) | {k for s in inputs for k in s})
    return [
        FieldMerge(
            field=f,
            reducer=config.field_reducers.get(f, config.default_reducer),
            before=base.get(f, ABSENT),
            inputs=tuple(s.get(f, ABSENT) for s in inputs),
            result=result.get(f, ABSENT),
        )
        for f in fields
    ]


def fork_event_id(
    tenant_id: str, run_id: str, seq: int, new_run_id: str, edit: Mapping[str, Any] | None = None
) -> str:
    """The id of the event that starts the fork of ``run_id`` at ``seq`` as
    ``new_run_id``: stable, so a fork asked again is the same event (one fork); with an
    ``edit`` (its patch, note and who asked), the same fork only with the same edit."""
    parts = [tenant_id, run_id, str(seq), new_run_id]
    if edit:
        parts.append(json.dumps(edit, sort_keys=True, separators=(",", ":"), default=str))
    return f"fork-{uuid.uuid5(_FORKS, chr(0x1F).join(parts)).hex}"


def patched(state: Mapping[str, Any], patch: Any) -> dict[str, Any]:
    """``state`` with the JSON Patch (RFC 6902) ``patch`` applied, ``state`` untouched:
    a fork's edit, checked before anything is written. InvalidPatch when ``patch`` is not
    a list of operations, an operation is malformed or does not apply (a path that is
    not there, a ``test`` that fails), or the result is not a JSON object."""
    if not isinstance(patch, list) or not all(isinstance(op, dict) for op in patch):
        raise errors.InvalidPatch(
            "a JSON Patch is a list of operations, each an object such as "
            '{"op": "replace", "path": "/field", "value": 1} (RFC 6902)'
        )
    try:
        result = jsonpatch.JsonPatch(patch).apply(dict(state), in_place=False)
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise errors.InvalidPatch(f"the patch does not apply to the state: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:  # an operation missing a member
        raise errors.InvalidPatch(f"a malformed operation in the patch: {exc!r}") from None
    if not isinstance(result, dict):
        raise errors.InvalidPatch(
            f"the patched state is a JSON {type(result).__name__}: a state is an object"
        )
    return result
