"""AlmaSaver: a LangGraph checkpoint saver that writes through ALMA Stream.

Every write is an event of the thread's run (``run_id`` = the thread id, key = the
thread id, so one partition keeps a thread's writes in order): ``graph.checkpoint``
(``aput``), ``graph.writes`` (``aput_writes``) and ``graph.upkeep`` (delete, delete for
runs, prune, copy). The checkpointer applies them in its batch transaction, exactly
once (:mod:`alma_core.storage.graphs`); reads go to PostgreSQL.

``wait="applied"`` (the default) returns from a write once the checkpointer applied it,
so any process reads it next, as with LangGraph's Postgres saver. ``wait="published"``
returns once the broker has it (durable, applied later, in order) and marks it in flight
(:mod:`alma_core.storage.inflight`): every saver's reads of the thread, in any process,
wait for such writes. Faster, and still never a stale read. A write the checkpointer
refuses raises its rejection either way (at the write, or at the next read of the
thread).

A task's writes name its node (from LangGraph's task path; a ``Send``'s from the
checkpoint this saver wrote), and a failed task's error, so :meth:`AlmaSaver.acomplete`
can publish the thread's outcome and ALMA learns from LangGraph runs as from any other.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import ERROR, TASKS, _DeltaSnapshot

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.publisher import Wait
from alma_core.settings import Settings
from alma_core.storage import graphs
from alma_core.storage.graphs import GraphReader
from alma_core.storage.inflight import TTL_S
from alma_core.types import WorkflowContext

_PULL, _PUSH = "~__pregel_pull, ", "~__pregel_push, "
_SENDS_KEPT = 1024  # checkpoints whose Send targets are remembered (a Send task's node)
_SEND_WAIT_S = 5.0  # the longest a Send task's writes wait for their checkpoint's aput
_QUIET_S = 0.05  # nothing of the thread saving this long: its checkpoint's aput is not coming
_PENDING_KEPT = 256  # a thread's writes remembered unconfirmed before the oldest are settled


def _encoded(typed: tuple[str, bytes | None]) -> dict[str, str]:
    kind, data = typed
    return {"type": kind, "data": base64.b64encode(data or b"").decode()}


def _sort_key(write: tuple[str, str, str, bytes | None, str, int]) -> tuple[Any, ...]:
    task_id, _, _, _, path, idx = write
    return writes_sort_key(path, task_id, idx)


MAX_THREAD_ID = 256  # a thread is an ALMA run: its id is the contract's run id


def thread_of(value: object) -> str:
    """A thread id as ALMA keeps it (a run id: 1 to 256 characters); any other is
    refused here, naming the thread and the limit, for reads and writes alike."""
    thread = str(value)
    if not 1 <= len(thread) <= MAX_THREAD_ID:
        shown = f"{thread[:40]!r}... " if len(thread) > 40 else f"{thread!r} "
        raise errors.ContextError(
            f"thread_id {shown}({len(thread)} characters): AlmaSaver keeps each thread as an "
            f"ALMA run, whose id is 1 to {MAX_THREAD_ID} characters. What to do: use a "
            "non-empty id of at most 256 characters (a hash of a longer one, say)"
        )
    return thread


class AlmaSaver(BaseCheckpointSaver[str]):
    """LangGraph's checkpointer on ALMA Stream (see the module docstring).

    ``client`` publishes and reads; ``tenant_id`` owns every thread this saver writes;
    ``workflow_id`` names the graph (a thread is a run of it). Build it in the event
    loop that runs the graph; sync calls (``graph.invoke``) work from other threads."""

    def __init__(
        self,
        client: AlmaClient,
        *,
        tenant_id: str,
        workflow_id: str = "langgraph",
        wait: Wait = "applied",
        timeout: float = 30.0,
        serde: SerializerProtocol | None = None,
    ) -> None:
        super().__init__(serde=serde)
        if wait not in ("applied", "published"):
            raise errors.ConfigError(f"wait must be 'applied' or 'published', not {wait!r}")
        self.client = client
        self.tenant_id = tenant_id
        self.workflow_id = workflow_id
        self.wait = wait
        self.timeout = timeout
        self._pending: dict[str, list[str]] = {}  # thread -> its events not seen applied
        self._refused: dict[str, list[errors.RejectedEvent]] = {}  # found, not raised yet
        # the nodes of each checkpoint's Sends (a Send task's node), the writes that wait
        # for a checkpoint's aput to learn them, and each thread's saves in flight
        self._sends: OrderedDict[tuple[str, str, str], list[str]] = OrderedDict()
        self._announced: dict[tuple[str, str, str], asyncio.Future[list[str] | None]] = {}
        self._saving: dict[str, int] = {}
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    @classmethod
    @contextlib.asynccontextmanager
    async def from_settings(
        cls, settings: Settings, *, tenant_id: str, **options: Any
    ) -> AsyncIterator[AlmaSaver]:
        """A saver with its own client (``ALMA_*`` settings), stopped on exit. A block
        that ends normally first waits for the saver's writes (:meth:`aflush`): under
        ``wait="published"`` a refusal raises there, never lost with the process."""
        async with AlmaClient(settings) as client:
            saver = cls(client, tenant_id=tenant_id, **options)
            yield saver
            await saver.aflush()

    @classmethod
    @contextlib.contextmanager
    def from_settings_sync(
        cls, settings: Settings, *, tenant_id: str, **options: Any
    ) -> Iterator[AlmaSaver]:
        """For synchronous code (``graph.invoke``): a saver whose client runs on an event
        loop of its own, in a thread, until the block ends. Its sync methods are called
        from any other thread (the caller's); the async ones belong to that loop."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="alma-saver", daemon=True)
        thread.start()
        opened = cls.from_settings(settings, tenant_id=tenant_id, **options)
        try:
            saver = asyncio.run_coroutine_threadsafe(opened.__aenter__(), loop).result()
            try:
                yield saver
            finally:
                closing = opened.__aexit__(None, None, None)
                asyncio.run_coroutine_threadsafe(closing, loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()

    async def aflush(self) -> None:
        """Wait until every write this saver published is applied, and raise the first
        refusal not raised yet (under ``wait="published"`` one otherwise waits for its
        thread's next read). Call it before the process ends; ``from_settings`` does."""
        await self._caught_up()

    def flush(self) -> None:
        self._sync(self.aflush())

    async def asetup(self) -> None:
        """What LangGraph's savers do in ``setup()``: bring ALMA's schema to the version
        this code needs (the migrations `alma up` and `alma db upgrade` apply; nothing
        when it is there already)."""
        await self.client.upgrade_schema()

    def setup(self) -> None:
        self._sync(self.asetup())

    # -- helpers --------------------------------------------------------------------

    async def _graphs(self) -> GraphReader:
        """This saver's reads: its tenant's, of its graph's threads."""
        return await self.client.graph_reader(self.tenant_id, self.workflow_id)

    def _ctx(self, thread_id: str) -> WorkflowContext:
        return WorkflowContext(
            tenant_id=self.tenant_id, workflow_id=self.workflow_id, run_id=thread_of(thread_id)
        )

    async def _send(
        self,
        type_: str,
        thread_id: str,
        payload: dict[str, Any],
        node_id: str | None = None,
        *,
        wait: Wait | None = None,
    ) -> None:
        """Publish one event of the thread; wait as ``wait`` (else ``self.wait``) says."""
        ctx = self._ctx(thread_id)
        if node_id is not None:
            ctx = WorkflowContext(**{**ctx.__dict__, "node_id": node_id})
        event = self.client.event(type_, ctx, payload)
        if (wait or self.wait) == "applied":
            await self.client.publish(event, wait="applied", timeout=self.timeout)
            return
        event_id = await self.client.publish(event)
        if not await (await self.client.in_flight()).mark(self.tenant_id, thread_id, event_id):
            # Redis cannot tell other processes of it: wait as "applied" (never stale)
            await self.client.applied(ctx, event_id, timeout=self.timeout)
            return
        pending = self._pending.setdefault(thread_id, [])
        pending.append(event_id)
        if len(pending) > 2 * _PENDING_KEPT:  # a thread only written: settle the oldest
            await self._settle(thread_id, pending[:-_PENDING_KEPT])

    async def _caught_up(self, thread_id: str | None = None) -> None:
        """Wait until this saver's writes of the thread (all threads: None) are applied.
        A refused write raises here once (its reason); a timeout leaves them owed."""
        for thread in list(self._pending) if thread_id is None else [thread_id]:
            ids = list(self._pending.get(thread, ()))
            if ids:
                await self._settle(thread, ids)
            if refused := self._refused.pop(thread, None):
                raise refused[0]

    async def _settle(self, thread: str, ids: list[str]) -> None:
        """Wait until these writes of the thread are applied or refused; forget them,
        keeping their refusals for the thread's next read. Concurrent writes (a
        fan-out's tasks) may reach the partition in another order than they returned:
        wait for the last, then for any the log does not hold yet."""
        refused = [await self._refusal(thread, ids[-1])]  # the last first, then the rest
        for event_id in await (await self._graphs()).unrecorded(thread, ids[:-1]):
            refused.append(await self._refusal(thread, event_id))
        if found := [r for r in refused if r is not None]:
            self._refused.setdefault(thread, []).extend(found)
        settled = set(ids)
        owed = [e for e in self._pending.get(thread, ()) if e not in settled]
        if owed:
            self._pending[thread] = owed
        else:
            self._pending.pop(thread, None)
        await (await self.client.in_flight()).clear(self.tenant_id, thread, ids)

    async def _readable(self, thread: str) -> None:
        """Before a read of the thread: this saver's and other processes' writes in
        flight are applied (:meth:`_others_applied`)."""
        await self._caught_up(thread)
        await self._others_applied(thread)

    async def _not_others(self, thread: str) -> None:
        """Raise when another graph owns the thread: one ownership model for reads and
        writes (a write there is refused). The reads leave such threads out, so this
        runs only when they found nothing."""
        owner = await (await self._graphs()).owner(thread)
        if owner is not None and owner != self.workflow_id:
            raise errors.ContextError(
                f"thread {thread!r} belongs to graph (workflow) {owner!r}, not "
                f"{self.workflow_id!r}: a saver reads and writes its own graph's threads "
                "only. What to do: use a saver with that workflow_id, or another thread id "
                f"(or free this one: {owner!r}'s saver deletes the thread, adelete_thread)"
            )

    async def _others_applied(self, thread: str) -> None:
        """Wait until the writes other savers (other processes) published to the thread
        under ``wait="published"`` and marked in flight are applied or refused, so a read
        never answers from a state they are about to change. Their refusals are theirs
        to raise; a write still unapplied after ``timeout`` raises here, never a stale
        read. With Redis down the marks cannot be read (docs/langgraph.md)."""
        in_flight = await self.client.in_flight()
        own = set(self._pending.get(thread, ()))
        marked = [e for e in await in_flight.marked(self.tenant_id, thread) or () if e not in own]
        if not marked:
            return
        waiting = await (await self._graphs()).unrecorded(thread, marked)
        deadline = asyncio.get_running_loop().time() + self.timeout
        for event_id in waiting:
            left = max(0.0, deadline - asyncio.get_running_loop().time())
            try:
                await self.client.applied(self._ctx(thread), event_id, timeout=left)
            except errors.RejectedEvent:
                continue  # never part of the thread's state
            except errors.EffectTimeout as exc:
                raise errors.EffectTimeout(
                    f"thread {thread!r} has a write from another process (event {event_id}, "
                    f'wait="published") not applied within {self.timeout:g} s, so it was '
                    "not read: its state would be stale. What to do: retry the read; check "
                    "that the checkpointer runs and keeps up (`alma offsets list` shows its "
                    f"lag). A write that never arrives stops blocking {TTL_S // 60} min "
                    "after the thread's newest write"
                ) from exc
        await in_flight.clear(self.tenant_id, thread, marked)

    async def _refusal(self, thread: str, event_id: str) -> errors.RejectedEvent | None:
        """Wait for the event's effect: None once applied, its rejection if refused."""
        try:
            await self.client.applied(self._ctx(thread), event_id, timeout=self.timeout)
        except errors.RejectedEvent as exc:
            return exc
        return None

    async def _node_of(self, thread: str, ns: str, checkpoint_id: str, path: str) -> str | None:
        """The node a task runs: a pull task's is in its path (LangGraph's own, such as
        ``__start__`` for the input, are no nodes of the graph's); a Send's is in the
        checkpoint the task runs from: from this saver's ``aput`` of it, else as stored.
        With ``durability="async"`` a task may finish before that ``aput`` begins (after
        the thread's earlier saves): the write waits for it while a save of the thread
        is in flight here, and goes without a node once none has been for a moment (the
        save chain broke: the ``aput`` is not coming), never longer than a few seconds."""
        if path.startswith(_PULL):
            node = path[len(_PULL) :].split(", ", 1)[0]
            return None if not node or node.startswith("__") else node
        index = path[len(_PUSH) :].split(", ", 1)[0] if path.startswith(_PUSH) else ""
        if not (index.isascii() and index.isdigit()):
            return None
        key = (thread, ns, checkpoint_id)
        sends = self._sends.get(key)
        if sends is None:
            reads = await self._graphs()
            stored = await reads.get(thread, ns, checkpoint_id, any_graph=True)
            if stored is not None:
                sends = self._remember(key, self._tuple(stored).checkpoint)
            elif key in self._sends:  # its aput began while PostgreSQL was asked
                sends = self._sends[key]
            else:
                sends = await self._announcement(thread, key)
        return sends[int(index)] if sends is not None and int(index) < len(sends) else None

    async def _announcement(self, thread: str, key: tuple[str, str, str]) -> list[str] | None:
        """The Send nodes of checkpoint ``key`` once its ``aput`` begins; None when it
        is not coming (see :meth:`_node_of`) or was forgotten for newer ones."""
        loop = asyncio.get_running_loop()
        announced = self._announced.setdefault(key, loop.create_future())
        deadline, quiet = loop.time() + _SEND_WAIT_S, 0
        while not announced.done() and loop.time() < deadline and quiet < 2:
            await asyncio.wait([announced], timeout=_QUIET_S)
            quiet = 0 if self._saving.get(thread) else quiet + 1
        if self._announced.get(key) is announced:  # it never came: forget it
            del self._announced[key]
        return announced.result() if announced.done() else None

    @contextlib.asynccontextmanager
    async def _save_of(self, thread: str) -> AsyncIterator[None]:
        """A save of the thread in flight (an ``aput``, a task's writes on their way):
        what a Send task's write may be waiting behind."""
        self._saving[thread] = self._saving.get(thread, 0) + 1
        try:
            yield
        finally:
            if left := self._saving[thread] - 1:
                self._saving[thread] = left
            else:
                del self._saving[thread]

    def _remember(self, key: tuple[str, str, str], checkpoint: Checkpoint) -> list[str]:
        """The nodes of the checkpoint's Sends, for its tasks' writes."""
        packets = checkpoint["channel_values"].get(TASKS)
        sends = [getattr(p, "node", "") for p in packets] if isinstance(packets, list) else []
        self._sends[key] = sends
        announced = self._announced.pop(key, None)
        if announced is not None and not announced.done():
            announced.set_result(sends)
        while len(self._sends) > _SENDS_KEPT:
            self._sends.popitem(last=False)
        while len(self._announced) > _SENDS_KEPT:  # the oldest wait goes on without a node
            oldest = self._announced.pop(next(iter(self._announced)))
            if not oldest.done():
                oldest.set_result(None)
        return sends

    def _tuple(self, stored: graphs.StoredCheckpoint) -> CheckpointTuple:
        def config(checkpoint_id: str) -> RunnableConfig:
            return {
                "configurable": {
                    "thread_id": stored.thread_id,
                    "checkpoint_ns": stored.checkpoint_ns,
                    "checkpoint_id": checkpoint_id,
                }
            }

        values = {
            channel: self.serde.loads_typed((kind, data or b""))
            for channel, kind, data in stored.values
            if kind != "empty"
        }
        checkpoint: Any = {
            **stored.checkpoint,
            "channel_values": {**(stored.checkpoint.get("channel_values") or {}), **values},
        }
        return CheckpointTuple(
            config(stored.checkpoint_id),
            checkpoint,
            stored.metadata,  # type: ignore[arg-type]
            config(stored.parent_checkpoint_id) if stored.parent_checkpoint_id else None,
            [
                (task_id, channel, self.serde.loads_typed((kind, data or b"")))
                for task_id, channel, kind, data, _, _ in sorted(stored.writes, key=_sort_key)
            ],
        )

    # -- reads --------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        configurable = config["configurable"]
        thread = thread_of(configurable["thread_id"])
        await self._readable(thread)
        stored = await (await self._graphs()).get(
            thread, configurable.get("checkpoint_ns", ""), get_checkpoint_id(config)
        )
        if stored is None:
            await self._not_others(thread)
            return None
        return await asyncio.to_thread(self._tuple, stored)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        configurable = (config or {}).get("configurable", {})
        thread = thread_of(configurable["thread_id"]) if "thread_id" in configurable else None
        if thread is None:
            await self._caught_up()
        else:
            await self._readable(thread)
        rows = await (await self._graphs()).listing(
            thread=thread,
            ns=configurable.get("checkpoint_ns"),
            checkpoint_id=get_checkpoint_id(config) if config else None,
            metadata=filter or None,
            before=get_checkpoint_id(before) if before else None,
            limit=limit,
        )
        if not rows and thread is not None:
            await self._not_others(thread)
        for stored in rows:
            yield await asyncio.to_thread(self._tuple, stored)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """What LangGraph rebuilds the checkpoint's delta channels from (its base class's
        contract): each channel's writes since its nearest stored value, and that value.
        One query (:data:`alma_core.storage.graphs.DELTA_HISTORY`), however far back the
        last snapshot is, where the base class reads one checkpoint at a time."""
        if not channels:
            return {}
        configurable = config["configurable"]
        thread = thread_of(configurable["thread_id"])
        await self._readable(thread)
        found = await (await self._graphs()).delta_history(
            thread, configurable.get("checkpoint_ns", ""), get_checkpoint_id(config), list(channels)
        )

        def decoded() -> dict[str, DeltaChannelHistory]:
            out: dict[str, DeltaChannelHistory] = {}
            for channel in channels:
                rows = sorted(
                    found.writes.get(channel, ()),
                    key=lambda w: (w[0], writes_sort_key(w[1], w[2], w[3])),
                )
                entry: DeltaChannelHistory = {
                    "writes": [
                        (task, channel, self.serde.loads_typed((kind, data or b"")))
                        for _, _, task, _, kind, data in rows
                    ]
                }
                if channel in found.seeds:
                    kind, value = found.seeds[channel]
                    entry["seed"] = (
                        value if kind == "json" else self.serde.loads_typed((kind, value or b""))
                    )
                out[channel] = entry
            return out

        return await asyncio.to_thread(decoded)

    # -- writes ---------------------------------------------------------------------

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        configurable = config["configurable"]
        thread = thread_of(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns", "")
        self._remember((thread, ns, checkpoint["id"]), checkpoint)  # before any await
        # As LangGraph's Postgres saver: primitives stay in the checkpoint, the other
        # values are stored once per (channel, version), those this checkpoint changed.
        inline = dict(checkpoint["channel_values"])
        blobs: dict[str, Any] = {}
        for channel, value in checkpoint["channel_values"].items():
            if isinstance(value, _DeltaSnapshot):
                blobs[channel] = inline.pop(channel)
                inline[channel] = True
            elif not (value is None or isinstance(value, str | int | float | bool)):
                blobs[channel] = inline.pop(channel)
        changed = {c: v for c, v in new_versions.items() if c in blobs}
        async with self._save_of(thread):
            values = await asyncio.to_thread(
                lambda: {c: _encoded(self.serde.dumps_typed(blobs[c])) for c in changed}
            )
            await self._send(
                "graph.checkpoint",
                thread,
                {
                    "checkpoint_ns": ns,
                    "checkpoint_id": checkpoint["id"],
                    "parent_checkpoint_id": configurable.get("checkpoint_id"),
                    "checkpoint": {**checkpoint, "channel_values": inline},
                    "values": values,
                    "new_versions": dict(new_versions),
                    "metadata": get_serializable_checkpoint_metadata(config, metadata),
                },
            )
        return {
            "configurable": {
                "thread_id": configurable["thread_id"],
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        if not writes:
            return
        configurable = config["configurable"]
        thread = thread_of(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns", "")
        checkpoint_id = configurable["checkpoint_id"]
        encoded = await asyncio.to_thread(
            lambda: [
                {
                    "idx": WRITES_IDX_MAP.get(channel, i),
                    "channel": channel,
                    "value": _encoded(self.serde.dumps_typed(value)),
                }
                for i, (channel, value) in enumerate(writes)
            ]
        )
        error = next((v for c, v in writes if c == ERROR), None)
        # A task's outcome: its regular writes, or its error (not interrupts, resumes)
        finished = error is not None or any(c not in WRITES_IDX_MAP for c, _ in writes)
        node = await self._node_of(thread, ns, checkpoint_id, task_path) if finished else None
        async with self._save_of(thread):
            await self._send(
                "graph.writes",
                thread,
                {
                    "checkpoint_ns": ns,
                    "checkpoint_id": checkpoint_id,
                    "task_id": task_id,
                    "task_path": task_path,
                    "writes": encoded,
                    "replace": all(c in WRITES_IDX_MAP for c, _ in writes),
                    "error": None
                    if error is None
                    else {"type": type(error).__name__[:256], "message": str(error)[:65536]},
                },
                node_id=node,
            )

    async def adelete_thread(self, thread_id: str) -> None:
        await self._send("graph.upkeep", str(thread_id), {"op": "delete_thread"})

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        if isinstance(run_ids, str):
            raise TypeError("run_ids must be a sequence of run ids, not one string")
        await self._caught_up()
        ids = [str(r) for r in run_ids]
        for thread in await (await self._graphs()).threads_of_runs(ids):
            await self._send("graph.upkeep", thread, {"op": "delete_runs", "run_ids": ids})

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Applied before it returns, whatever ``wait`` says: the copy is an event of the
        source thread, and the target's reads must see it."""
        await self._caught_up(str(target_thread_id))
        await self._send(
            "graph.upkeep",
            str(source_thread_id),
            {"op": "copy", "target_thread_id": str(target_thread_id)},
            wait="applied",
        )

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a sequence of thread ids, not one string")
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"unknown prune strategy {strategy!r}: keep_latest or delete")
        for thread in thread_ids:
            await self._send("graph.upkeep", str(thread), {"op": "prune", "strategy": strategy})

    def get_next_version(self, current: str | None, channel: None) -> str:
        """As LangGraph's Postgres saver: a zero-padded counter and a random fraction."""
        if current is None:
            number = 0
        elif isinstance(current, int):
            number = current
        else:
            number = int(current.split(".")[0])
        return f"{number + 1:032}.{random.random():016}"

    # -- the thread's outcome -------------------------------------------------------

    async def acomplete(
        self,
        thread_id: str,
        *,
        success: bool | None = None,
        task: str | None = None,
        error_message: str | None = None,
        duration_ms: int | None = None,
        event_id: str | None = None,
    ) -> str:
        """Publish the thread's outcome (``workflow.completed``) for ALMA to learn from:
        its nodes (those whose tasks finished) and how many failed, a success unless one
        did (or as ``success`` says), its duration since its first event unless given.
        ``event_id`` makes it idempotent. Returns the event id."""
        thread = thread_of(thread_id)
        await self._readable(thread)
        summary = await (await self._graphs()).summary(thread)
        failed = sum(summary.nodes.values())
        if duration_ms is None:
            started = summary.started_at or datetime.now(UTC)
            duration_ms = max(0, int((datetime.now(UTC) - started).total_seconds() * 1000))
        ok = failed == 0 if success is None else success
        return await self.client.workflow_completed(
            self._ctx(thread),
            success=ok,
            duration_ms=duration_ms,
            node_count=len(summary.nodes),
            nodes_succeeded=len(summary.nodes) - failed,
            nodes_failed=failed,
            error_message=error_message or (None if ok else summary.first_error),
            task=task,
            event_id=event_id,
            wait=self.wait,
            timeout=self.timeout,
        )

    # -- sync calls, from threads other than the loop's -------------------------------

    def _sync(self, coro: Any) -> Any:
        loop = self.loop
        if loop is None:
            coro.close()
            raise errors.ConfigError(
                "AlmaSaver was built outside an event loop: build it inside the loop that "
                "runs the graph (async with AlmaSaver.from_settings(...))"
            )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise asyncio.InvalidStateError(
                "synchronous calls to AlmaSaver are only allowed from another thread; in the "
                "loop, use the async interface (await graph.ainvoke(...), aget_tuple(...))"
            )
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        result: CheckpointTuple | None = self._sync(self.aget_tuple(config))
        return result

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        result: Mapping[str, DeltaChannelHistory] = self._sync(
            self.aget_delta_channel_history(config=config, channels=channels)
        )
        return result

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        async def collect() -> list[CheckpointTuple]:
            found = self.alist(config, filter=filter, before=before, limit=limit)
            return [t async for t in found]

        yield from self._sync(collect())

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        result: RunnableConfig = self._sync(self.aput(config, checkpoint, metadata, new_versions))
        return result

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._sync(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._sync(self.adelete_thread(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._sync(self.adelete_for_runs(run_ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._sync(self.acopy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self._sync(self.aprune(thread_ids, strategy=strategy))
