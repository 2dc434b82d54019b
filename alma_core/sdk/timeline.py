"""A run's past through the SDK (``Timeline(client)``): the state at any seq, what changed
between two checkpoints, a merge explained, and a fork that starts a new run from any
moment of an old one (docs/time-travel.md).

A fork is one ``node.completed`` of the new run: the old state in full, ``expected_seq``
0 (refused if the new run has a checkpoint already), node ``fork``, its lineage in the
checkpoint's metadata (``forked_from``: run, seq, branch, state hash) and an event id
derived from (tenant, run, seq, new run): asked again, it is the same event, applied
once. The new run then goes on like any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from alma_core import errors, history
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.waiter import Applied
from alma_core.types import Checkpoint, WorkflowContext

if TYPE_CHECKING:
    from alma_core.storage.reader import CheckpointReader

FORK_NODE = "fork"


@dataclass(frozen=True)
class MergeView:
    """A merged checkpoint beside its inputs, field by field."""

    merged: Checkpoint
    before: Checkpoint | None
    labels: list[str]
    fields: list[history.FieldMerge]

    def to_doc(self) -> dict[str, Any]:
        return {
            "seq": self.merged.seq,
            "join_id": self.merged.metadata.get("join_id"),
            "before_seq": self.before.seq if self.before else None,
            "inputs": self.labels,
            "fields": [f.to_doc(self.labels) for f in self.fields],
            "state": self.merged.state,
        }


class Timeline:
    """A run's past over ``client`` (one tenant per call), as ``WorkflowHooks(client)``
    and ``RunState(client, ctx)`` are. Reads go through the tenant's
    :class:`~alma_core.storage.reader.CheckpointReader` (``reader``: another source of
    them, for reads without a client, as the CLI's); forks need the client."""

    def __init__(
        self,
        client: AlmaClient | None = None,
        *,
        reader: Callable[[str], Awaitable[CheckpointReader]] | None = None,
    ) -> None:
        if reader is None:
            if client is None:
                raise errors.ConfigError("a Timeline needs a client, or a reader to read with")
            reader = client.reader
        self.reader = reader
        self.client = client

    @staticmethod
    def _run(ctx: WorkflowContext) -> tuple[str, str]:
        """The run's tenant and id: all a read of its past needs (the workflow is the
        run's own; a fork checks one given against it)."""
        if not (ctx.tenant_id and ctx.run_id):
            raise errors.ContextError("a run's past needs its tenant_id and run_id")
        return ctx.tenant_id, ctx.run_id

    async def state_at(
        self, ctx: WorkflowContext, seq: int, branch_id: str | None = None
    ) -> Checkpoint | None:
        """The state of the run's main line (or ``branch_id``) as it was at ``seq``: its
        newest checkpoint at or below that seq. None before the first one."""
        tenant, run = self._run(ctx)
        return await (await self.reader(tenant)).state_at(run, seq, branch_id)

    async def checkpoint(self, ctx: WorkflowContext, seq: int) -> Checkpoint:
        """The run's checkpoint ``seq`` (any branch); a clear error when there is none."""
        return (await self._checkpoints(ctx, [seq]))[seq]

    async def _checkpoints(self, ctx: WorkflowContext, seqs: list[int]) -> dict[int, Checkpoint]:
        """The run's checkpoints at ``seqs``, read at once (of one projection: a run
        rebuilt meanwhile is seen all before or all after); a clear error for a seq it
        has not."""
        tenant, run = self._run(ctx)
        found = await (await self.reader(tenant)).get_many(run, seqs)
        for seq in seqs:
            if seq not in found:
                raise errors.NotFound(
                    f"run {run!r} of tenant {tenant!r} has no checkpoint {seq}: "
                    "`alma checkpoints RUN` lists those it has"
                )
        return found

    async def diff(self, ctx: WorkflowContext, a: int, b: int) -> list[history.Change]:
        """What changed from checkpoint ``a`` to checkpoint ``b`` of the run, by path."""
        both = await self._checkpoints(ctx, [a, b])
        return history.diff(both[a].state, both[b].state)

    async def merge(self, ctx: WorkflowContext, seq: int) -> MergeView:
        """Merged checkpoint ``seq`` with its inputs, and each field's reducer."""
        tenant, run = self._run(ctx)
        parts = await (await self.reader(tenant)).merge_parts(run, seq)
        if parts is None:
            raise errors.NotFound(
                f"checkpoint {seq} of run {run!r} is no merge: `alma runs show RUN` lists "
                "the run's joins and their checkpoints"
            )
        inputs = parts.inputs()
        fields = history.explain_merge(
            parts.merged.state,
            parts.before.state if parts.before and not parts.request.get("states") else None,
            [state for _, state in inputs],
            parts.config(),
        )
        return MergeView(parts.merged, parts.before, [label for label, _ in inputs], fields)

    async def fork(
        self,
        ctx: WorkflowContext,
        at_seq: int,
        new_run_id: str,
        *,
        branch_id: str | None = None,
        patch: list[dict[str, Any]] | None = None,
        note: str | None = None,
        asked_by: str | None = None,
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> Applied:
        """Start run ``new_run_id`` (same tenant and workflow) from the state of
        ``ctx.run_id``'s main line (or ``branch_id``) at ``at_seq``; waits until its
        first checkpoint is durable. Asked again with the same arguments, it is the same
        fork; a new run id that has a checkpoint already is refused.

        ``patch``, a JSON Patch (RFC 6902), edits that state first: checked before
        anything is written (InvalidPatch: not a patch, or it does not apply). The new
        run's lineage records the patch, ``note`` (why) and ``asked_by`` (who), which
        its pages and ``alma runs show`` print."""
        tenant, run = self._run(ctx)
        if self.client is None:
            raise errors.ConfigError("a fork publishes: build the Timeline with a client")
        if new_run_id == run:
            raise errors.ContextError("a fork is a new run: give it a run id of its own")
        reader = await self.reader(tenant)
        source = await reader.state_at(run, at_seq, branch_id)
        if source is None:
            where = f"branch {branch_id!r}" if branch_id else "the main line"
            raise errors.NotFound(
                f"run {run!r} of tenant {tenant!r} has no checkpoint on {where} at or "
                f"before seq {at_seq}: nothing to fork (`alma checkpoints {run}`)"
            )
        workflow = await reader.workflow_of(run)
        if workflow is None or (ctx.workflow_id and ctx.workflow_id != workflow):
            raise errors.ContextError(
                f"run {run!r} belongs to workflow {workflow!r}, not {ctx.workflow_id!r}"
            )
        state = source.state if patch is None else history.patched(source.state, patch)
        new = WorkflowContext(tenant, workflow, None, new_run_id, FORK_NODE)
        edit = {
            k: v
            for k, v in (("patch", patch), ("note", note), ("asked_by", asked_by))
            if v is not None
        }
        lineage = {
            "run_id": run,
            "seq": source.seq,
            "at_seq": at_seq,
            "branch_id": branch_id,
            "state_hash": source.state_hash,
            **edit,
        }
        payload = {"state": state, "expected_seq": 0, "metadata": {"forked_from": lineage}}
        event_id = history.fork_event_id(tenant, run, at_seq, new_run_id, edit)
        # Checked before publishing where it can be: a refused fork must write nothing
        # into the record of the run that holds that id (a dead letter would)
        first = (await reader.get_many(new_run_id, [1])).get(1)
        if first is not None and first.event_id == event_id:
            return Applied(event_id, "checkpointed", first.seq)  # the same fork, asked again
        if first is not None:
            raise errors.StaleExpectedSeq(
                f"run {new_run_id!r} has checkpoints already: a fork starts a new run. "
                "Choose another new run id"
            )
        event = self.client.event("node.completed", new, payload, event_id=event_id)
        try:
            return await self.client.publish(event, wait="applied", timeout=timeout)
        except errors.StaleExpectedSeq as exc:
            raise errors.StaleExpectedSeq(
                f"run {new_run_id!r} has checkpoints already: a fork starts a new run. "
                f"Choose another new run id ({exc.message})"
            ) from None
