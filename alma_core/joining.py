"""Merging parallel branches at a ``branch.join``: pure rules, no I/O.

* ``branch_ids``: the latest state of each branch, folded **in the order given**
  (never by completion time or name), is applied onto the main line's head
  with the reducers (a branch holds what it wrote, so a list ``append``ed by
  three branches gets each branch's items once, after the main line's).
* **A join consumes its branches**: once merged, a branch has no head, so the next
  fan-out with the same branch names (a loop, a second parallel step) starts it
  from empty, forked from the main line as it is then, and nothing is merged
  twice. Its checkpoints stay in the run's history.
* ``states``: the given states, folded in order; the main line is not a base.
* Reducers: the request's ``reducers`` / ``default_reducer`` / ``strict`` when
  given, else the workflow's registered configuration, else ``last_value``.
* Strict mode compares the branches with each other: two *different* values
  for a field with no reducer is an error naming the field and the branches.

Errors name the branch or the field; they become an error reply and a dead
letter, never a hang. :class:`JoinPlanner` takes a batch's joins in partition order
and decides each one (merge, error, or the earlier reply again) from what the store
loaded for the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from alma_core import errors
from alma_core.reducers import ReducerConfig, ReducerRegistry, apply_updates, merge_states
from alma_core.schemas.events import BranchJoin, BranchJoinPayload, MergeReply
from alma_core.sequencing import (
    HASH_SCHEME,
    MAIN,
    Head,
    RunKey,
    canonical_state,
    hash_scheme,
    state_limit,
)


@dataclass(frozen=True)
class Merge:
    state: dict[str, Any]
    state_json: str
    state_hash: str
    size_bytes: int
    merged_from: tuple[int, ...]


_NO_REDUCERS = ReducerConfig()  # a workflow with none registered


def config_for(payload: BranchJoinPayload, registered: ReducerConfig | None) -> ReducerConfig:
    """The request's reducer settings, falling back field by field to the workflow's."""
    base = registered or _NO_REDUCERS
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
    says: str | None = None,
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
                + " since its last join: a branch is known once a node in it has completed, "
                "and a join consumes the branches it merges"
            )
        heads = [branches[b] for b in payload.branch_ids]
        merged_from = tuple(h.seq for h in heads)
        try:
            folded = merge_states([h.state for h in heads], config, registry, validated=True)
        except errors.ConflictingUpdate as exc:
            raise errors.ConflictingUpdate(
                f"{exc.message} (branches {', '.join(payload.branch_ids)})"
            ) from None
        state = apply_updates(main.state if main else {}, folded, config, registry, validated=True)
    else:
        assert payload.states is not None  # the contract requires one of them
        state = merge_states(payload.states, config, registry, validated=True)
    state_json, digest, size = canonical_state(state, _scheme(main, branches))
    if size > max_state_bytes:
        says = says or f"the limit is {max_state_bytes}"
        raise errors.StateTooLarge(f"the merged state is {size} bytes; {says}")
    return Merge(state, state_json, digest, size, merged_from)


def _scheme(main: Head | None, branches: Mapping[str, Head]) -> str:
    """The merged state's hash scheme: the main line's, else the run's (its branches'),
    else that of new runs."""
    for head in (main, *branches.values()):
        if head is not None:
            return hash_scheme(head.state_hash)
    return HASH_SCHEME


@dataclass
class RunAtJoin:
    """What the joiner knows of a run while it merges a batch's joins."""

    tenant_id: str
    workflow_id: str
    last_seq: int
    heads: dict[str, Head]  # branch key -> head, the main line under MAIN
    pruned: bool = False  # retention began on this closed run: no more merges


@dataclass(frozen=True)
class MergedCheckpoint:
    """A merge the planner made: the run's next seq on the main line."""

    run_id: str
    tenant_id: str
    seq: int
    parent_seq: int | None
    merge: Merge


@dataclass(frozen=True)
class JoinDecision:
    """What one join comes to: its reply (an earlier one again for a duplicate) and,
    for a new ``ok``, the merged checkpoint; for a new error, the rejection. ``lost``:
    the hand-off came from a checkpointer commit PostgreSQL no longer has (a failover
    lost it): nothing is merged or answered, as the checkpointer reads the join again
    from its topic and hands it off again."""

    event: BranchJoin
    reply: dict[str, Any]
    checkpoint: MergedCheckpoint | None = None
    rejection: errors.RejectedEvent | None = None
    duplicate: bool = False
    consumed: tuple[str, ...] = ()  # the branches the merge consumed
    lost: bool = False


def reply_of(event: BranchJoin) -> dict[str, Any]:
    """The fields every answer to ``event`` carries."""
    return {"join_id": event.payload.join_id, "run_id": event.run_id, "tenant_id": event.tenant_id}


def error_reply(event: BranchJoin, exc: errors.RejectedEvent) -> dict[str, Any]:
    """The answer to a join that can never be merged (the joiner's, or the
    checkpointer's for a join it refused: the caller waits on the reply topic)."""
    return {**reply_of(event), "status": "error", "error": f"{exc.reason}: {exc.message}"}


class JoinPlanner:
    """The joiner's decisions for one batch, in partition order, from what the store
    loaded: the runs (locked, by tenant and run id), their heads, the replies already
    given (by tenant, run and join id), the workflows' registered reducers, and for
    each join's position the first node checkpoint after it (absent: none). A join
    merged here moves its run's main line and seq, so a later join of the same run in
    the batch merges onto it."""

    def __init__(
        self,
        *,
        runs: dict[RunKey, RunAtJoin],
        replies: dict[tuple[str, str, str], dict[str, Any]],
        registered: dict[tuple[str, str], ReducerConfig],
        later_node: dict[tuple[str, str, int], int],
        registry: ReducerRegistry,
        max_state_bytes: int,
        state_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.runs = runs
        self.replies = dict(replies)
        self.registered = registered
        self.later_node = later_node
        self.registry = registry
        self.max_state_bytes = max_state_bytes
        self.state_limits = state_limits or {}  # tenants' own limits, below the global

    def decide(self, event: BranchJoin, position: int | None) -> JoinDecision:
        payload = event.payload
        key = (event.tenant_id, event.run_id, payload.join_id)
        if key in self.replies:
            return JoinDecision(event, self.replies[key], duplicate=True)
        known = self.runs.get((event.tenant_id, event.run_id))
        if position is not None and position > (known.last_seq if known else 0):
            # the checkpointer handed it off after a commit that made the run reach
            # ``position``: a run behind it lost that commit (a PostgreSQL failover with
            # asynchronous replication). Merging now would merge branches the run no
            # longer has, or answer an error that then stands for the join forever.
            return JoinDecision(event, reply_of(event), lost=True)
        reply = reply_of(event)
        try:
            run = self._run(event)
            self._check_position(event, position)
            limit, says = state_limit(self.state_limits, event.tenant_id, self.max_state_bytes)
            merged = merge(
                payload,
                main=run.heads.get(MAIN),
                branches={k: h for k, h in run.heads.items() if k != MAIN},
                registered=self.registered.get((run.tenant_id, run.workflow_id)),
                registry=self.registry,
                max_state_bytes=limit,
                says=says,
            )
        except errors.RejectedEvent as exc:
            reply = error_reply(event, exc)
            decision = JoinDecision(event, reply, rejection=exc)
        else:
            main = run.heads.get(MAIN)
            checkpoint = MergedCheckpoint(
                event.run_id, event.tenant_id, run.last_seq + 1, main.seq if main else None, merged
            )
            run.last_seq = checkpoint.seq
            run.heads[MAIN] = Head(checkpoint.seq, merged.state_hash, merged.state)
            consumed = tuple(dict.fromkeys(payload.branch_ids or ()))
            for branch in consumed:
                run.heads.pop(branch, None)
            reply.update(status="ok", merged_state=merged.state, checkpoint_seq=checkpoint.seq)
            decision = JoinDecision(event, reply, checkpoint=checkpoint, consumed=consumed)
        MergeReply.model_validate(reply)  # the reply we send keeps our own contract
        self.replies[key] = reply
        return decision

    def _run(self, event: BranchJoin) -> RunAtJoin:
        run = self.runs.get((event.tenant_id, event.run_id))
        if run is None:
            raise errors.MissingBranch(f"run {event.run_id!r} is unknown for this tenant")
        if run.pruned:
            raise errors.RunPruned(
                f"run {event.run_id!r} is closed and retention has pruned it: no more merges"
            )
        return run

    def _check_position(self, event: BranchJoin, position: int | None) -> None:
        """The join is merged at its place in the partition: every checkpoint after its
        position must be a merge of an earlier join (the joiner takes joins in partition
        order). A node's checkpoint there means events after the join were applied
        first, and a merge now would fold them in and take a seq after theirs."""
        if position is None:  # a hand-off from before the position header existed
            return
        later = self.later_node.get((event.tenant_id, event.run_id, position))
        if later is not None:
            raise errors.RunMovedPastJoin(
                f"the run was at seq {position} at the join, and seq {later} (a later event) "
                "was applied before the merge: publish a run's next events only after its "
                "merge reply (the SDK's merge() waits for it)"
            )
