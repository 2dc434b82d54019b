"""A run's past, in pure code: what changed between two states, a merge explained field
by field, and the identity of a fork.

* :func:`diff` compares two JSON values by path: keys added, removed and changed, lists
  by index (an item inserted at the front shows as every later index changed, plus
  one added at the end: positions are what a reducer such as ``append`` works on).
  Paths are JSON Pointers (RFC 6901: ``/plan/steps/2``, ``~1`` for ``/`` in a key).
  A value that changes type (``1`` to ``"1"``, ``1`` to ``true``) is changed even
  where Python calls them equal.
* :func:`explain_merge` lays a merged checkpoint beside its inputs: for each field,
  the reducer that folded it, the main line's value before, each input's value and
  the result.
* :func:`fork_event_id` names the event that starts a fork: the same source run, seq
  and new run give the same id, so a fork asked twice (a retry, a re-delivery) is
  one fork.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from alma_core.reducers import ReducerConfig

ChangeKind = Literal["added", "removed", "changed"]
MISSING: Any = None  # how an absent value is shown beside a present one
_FORKS = uuid.UUID("6f1d3c1e-5a0b-4c55-9f43-2f7c9e1b8a10")  # namespace of fork event ids


@dataclass(frozen=True)
class Change:
    """One difference: where (a JSON Pointer), what kind, the values on each side."""

    path: str
    kind: ChangeKind
    before: Any = None
    after: Any = None

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "kind": self.kind}
        if self.kind != "added":
            doc["before"] = self.before
        if self.kind != "removed":
            doc["after"] = self.after
        return doc


def pointer(parent: str, key: str | int) -> str:
    """``parent`` extended by one key or index, escaped as RFC 6901 says."""
    return f"{parent}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def diff(before: Any, after: Any, path: str = "") -> list[Change]:
    """Every difference from ``before`` to ``after``, in path order (keys sorted)."""
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
        changes = []
        for i in range(max(len(before), len(after))):
            here = pointer(path, i)
            if i >= len(after):
                changes.append(Change(here, "removed", before=before[i]))
            elif i >= len(before):
                changes.append(Change(here, "added", after=after[i]))
            else:
                changes += diff(before[i], after[i], here)
        return changes
    return [] if _same(before, after) else [Change(path, "changed", before, after)]


@dataclass(frozen=True)
class FieldMerge:
    """How one field of a merged state came to be."""

    field: str
    reducer: str
    before: Any  # the main line's value before the merge (None: absent)
    inputs: tuple[Any, ...]  # each input's value, in the merge's order (None: absent)
    result: Any

    def to_doc(self, labels: Sequence[str]) -> dict[str, Any]:
        return {
            "field": self.field,
            "reducer": self.reducer,
            "before": self.before,
            "inputs": dict(zip(labels, self.inputs, strict=True)),
            "result": self.result,
        }


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
            before=base.get(f, MISSING),
            inputs=tuple(s.get(f, MISSING) for s in inputs),
            result=result.get(f, MISSING),
        )
        for f in fields
    ]


def fork_event_id(tenant_id: str, run_id: str, seq: int, new_run_id: str) -> str:
    """The id of the event that starts the fork of ``run_id`` at ``seq`` as
    ``new_run_id``: stable, so a fork asked again is the same event (one fork)."""
    name = "\x1f".join((tenant_id, run_id, str(seq), new_run_id))
    return f"fork-{uuid.uuid5(_FORKS, name).hex}"
