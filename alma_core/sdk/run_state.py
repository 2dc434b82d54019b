"""RunState: a run's working state with semantic keys, for the orchestrator's workers
and planners (the memory SDK seed's ``WorkflowState``, without its race).

The seed's helper reads the state, changes it and writes it back, so two workers
updating one run at once lose one update. Here every write is an ``updates``
event: the run's single writer (the checkpointer that owns the run's partition)
folds it into the latest state with the workflow's reducers, so concurrent
``record_action`` (``append``) and ``increment`` (``sum``) calls all count. Writes
wait for their effect (read-your-writes); reads are fresh (Redis, then
PostgreSQL). ``set(..., expected_seq=n)`` is optimistic locking: it fails with
StaleExpectedSeq when someone wrote since seq ``n``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.types import WorkflowContext

ACTIONS = "actions"


class RunState:
    def __init__(
        self,
        client: AlmaClient,
        ctx: WorkflowContext,
        *,
        counters: tuple[str, ...] = (),
        lists: tuple[str, ...] = (),
        writer: str = "run-state",
        timeout: float = 30.0,
    ) -> None:
        """``counters`` are summed, ``lists`` appended to (``actions`` always is);
        ``writer`` is the node id the writes are recorded under unless ``ctx`` has one."""
        ctx.validate(require_tenant=True)
        if not (ctx.tenant_id and ctx.workflow_id and ctx.run_id):
            raise errors.ContextError("RunState needs tenant_id, workflow_id and run_id")
        self.client = client
        self.ctx = ctx if ctx.node_id else replace(ctx, node_id=writer)
        self.counters = frozenset(counters)
        self.lists = frozenset({ACTIONS, *lists})
        self.timeout = timeout
        self.seq: int | None = None  # the seq of the last write or read
        self._declared = False

    async def _write(self, updates: dict[str, Any], expected_seq: int | None = None) -> int | None:
        if not self._declared:
            fields = dict.fromkeys(self.counters, "sum") | dict.fromkeys(self.lists, "append")
            await self.client.register_reducers(self.ctx, fields)
            self._declared = True
        event = self.client.event(
            "node.completed", self.ctx, {"updates": updates, "expected_seq": expected_seq}
        )
        applied = await self.client.publish(event, wait="applied", timeout=self.timeout)
        self.seq = applied.seq
        return applied.seq

    async def set(self, key: str, value: Any, *, expected_seq: int | None = None) -> int | None:
        """Set ``key`` (last value wins, unless the workflow registered another reducer).
        Returns the run's seq after the write."""
        if key in self.counters or key in self.lists:
            raise errors.ContextError(
                f"{key!r} is a {'counter' if key in self.counters else 'list'}: "
                "use increment() or record_action()/append()"
            )
        return await self._write({key: value}, expected_seq)

    async def append(self, key: str, *items: Any) -> int | None:
        if key not in self.lists:
            raise errors.ContextError(f"{key!r} is not a list of this RunState: pass lists=(...)")
        return await self._write({key: list(items)})

    async def record_action(self, name: str) -> int | None:
        """Append ``name`` to the run's ``actions`` (atomic: no read-modify-write)."""
        return await self.append(ACTIONS, name)

    async def increment(self, key: str, by: int | float = 1) -> int | None:
        if key not in self.counters:
            raise errors.ContextError(
                f"{key!r} is not a counter of this RunState: pass counters=({key!r},)"
            )
        return await self._write({key: by})

    async def get_all(self) -> dict[str, Any]:
        """The run's state now (the branch's, if the context names one)."""
        point = await self.client.resume(self.ctx)
        head = point.branch_heads.get(self.ctx.branch_id)
        self.seq = head.seq if head else None
        return dict(head.state) if head else {}

    async def get(self, key: str, default: Any = None) -> Any:
        return (await self.get_all()).get(key, default)

    async def has(self, key: str) -> bool:
        """The idempotency check: has the run already got ``key``?"""
        return key in await self.get_all()

    async def actions(self) -> list[Any]:
        return list(await self.get(ACTIONS, []))
