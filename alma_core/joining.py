"""Merging parallel branches at a ``branch.join``: pure rules, no I/O.

* ``branch_ids``: the latest state of each branch, folded **in the order given**
  (never by completion time or name), is applied onto the main line's head
  with the reducers (a branch holds what it wrote, so a list ``append``ed by
  three branches gets each branch's items once, after the main line's).
* ``states``: the given states, folded in order; the main line is not a base.
* Reducers: the request's ``reducers`` / ``default_reducer`` / ``strict`` when
  given, else the workflow's registered configuration, else ``last_value``.
* Strict mode compares the branches with each other: two *different* values
  for a field with no reducer is an error naming the field and the branches.

Errors name the branch or the field; they become an error reply and a dead
letter, never a hang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from alma_core import errors
from alma_core.reducers import ReducerConfig, ReducerRegistry, apply_updates, merge_states
from alma_core.sequencing import Head, canonical_json
from schemas.events import BranchJoinPayload


@dataclass(frozen=True)
class Merge:
    state: dict[str, Any]
    state_json: str
    state_hash: str
    size_bytes: int
    merged_from: tuple[int, ...]


def config_for(payload: BranchJoinPayload, registered: ReducerConfig | None) -> ReducerConfig:
    """The request's reducer settings, falling back field by field to the workflow's."""
    base = registered or ReducerConfig()
    return ReducerConfig(
        field_reducers={**base.field_reducers, **(payload.reducers or {})},
        default_reducer=payload.default_reducer or base.default_reducer,
        strict=base.strict if payload.strict is None else payload.strict,
    )


def merge(
    payload: BranchJoinPayload,
    *,
    main: Head | None,
    branches: Mapping[str, Head],
    registered: ReducerConfig | None,
    registry: ReducerRegistry,
    max_state_bytes: int,
) -> Merge:
    config = config_for(payload, registered)
    config.validate(registry)
    merged_from: tuple[int, ...] = ()
    if payload.branch_ids is not None:
        missing = [b for b in payload.branch_ids if b not in branches]
        if missing:
            raise errors.MissingBranch(
                f"branch {missing[0]!r} has no checkpoint in this run"
                + (f" (nor do {', '.join(map(repr, missing[1:]))})" if len(missing) > 1 else "")
                + "; a branch is known once a node in it has completed"
            )
        heads = [branches[b] for b in payload.branch_ids]
        merged_from = tuple(h.seq for h in heads)
        try:
            folded = merge_states([h.state for h in heads], config, registry)
        except errors.ConflictingUpdate as exc:
            raise errors.ConflictingUpdate(
                f"{exc.message} (branches {', '.join(payload.branch_ids)})"
            ) from None
        state = apply_updates(main.state if main else {}, folded, config, registry)
    else:
        assert payload.states is not None  # the contract requires one of them
        state = merge_states(payload.states, config, registry)
    state_json = canonical_json(state)
    size = len(state_json.encode())
    if size > max_state_bytes:
        raise errors.StateTooLarge(
            f"the merged state is {size} bytes; the limit is {max_state_bytes}"
        )
    return Merge(state, state_json, hashlib.sha256(state_json.encode()).hexdigest(), size,
                 merged_from)  # fmt: skip
