"""Telling waiters that a run's events had their effect, the moment the batch commits.

The checkpointer ends each batch transaction with one ``NOTIFY`` per run the batch
touched (recorded or dead-lettered); PostgreSQL delivers it when, and only if, the
transaction commits. ``AlmaClient.applied`` (and so ``RunState``) listens on one
connection of its own and re-reads the run's effect when its run is named, instead of
polling on a back-off (which cost up to its pause after the commit: ~20 ms of a 13 ms
hop). A notification names a run by a hash of (tenant, run id), so a listener learns no
tenant's identifiers. Notifications are a hint: a waiter still reads PostgreSQL, and
still re-reads every ``POLL_S`` if a notification is lost (its connection dropped).

A waiter reads once before it first waits (its event may have been applied before it
watched), unless the client watched the run from before publishing the event
(:meth:`EffectListener.expect`, on a listener already open): then the commit's
notification cannot have been missed, and a write waits for it with one read, not two.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from typing import Any

import asyncpg

from alma_core.storage import postgres

CHANNEL = "alma_effects"
POLL_S = 1.0  # a waiter's re-read while notifications arrive (a safety net only)
EXPECTED_KEPT = 4096  # events published and expected, not yet waited for (per listener)


def token(tenant_id: str, run_id: str) -> str:
    """What a notification carries for a run: no identifiers in clear."""
    return hashlib.sha256(f"{tenant_id}\x00{run_id}".encode()).hexdigest()[:32]


def tokens(runs: Iterable[tuple[str, str]]) -> list[str]:
    """The notifications for these (tenant, run id) pairs, each once, in a fixed order."""
    return sorted({token(t, r) for t, r in runs})


# One notification per token, as a statement's main query (the checkpointer's batch
# write ends with it: no round trip of its own).
NOTIFY = "SELECT pg_notify({channel}, t) FROM unnest({tokens}::text[]) AS t"
_NOTIFY_ALONE = NOTIFY.format(channel="$1", tokens="$2")


async def announce(conn: asyncpg.Connection, runs: Iterable[tuple[str, str]]) -> None:
    """Inside the batch transaction: name each run to the listeners on commit."""
    named = tokens(runs)
    if named:
        await conn.execute(_NOTIFY_ALONE, CHANNEL, named)


class EffectListener:
    """One LISTEN connection; ``watch(tenant, run)`` gives an event set whenever a
    batch that touched the run commits. ``alive`` is False once the connection is
    gone (waiters then poll, and the owner may open a new listener)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self.alive = True
        self.wakeups = 0  # notifications that woke a waiter
        self.early = 0  # waits on an event watched since before its publish (no first read)
        self._expected: OrderedDict[str, tuple[str, asyncio.Event]] = OrderedDict()

    @classmethod
    async def open(cls, dsn: str) -> EffectListener:
        conn = await postgres.connect_first(dsn)
        listener = cls(conn)
        conn.add_termination_listener(listener._lost)
        await conn.add_listener(CHANNEL, listener._notified)
        return listener

    def expect(self, event_id: str, tenant_id: str, run_id: str) -> None:
        """Watch the run from now on for ``event_id``, about to be published: a commit of
        it after this cannot be missed, so its ``watch`` needs no read before its first
        wait. The last ``EXPECTED_KEPT`` are kept (events published and never waited for
        fall out)."""
        if not self.alive:
            return
        self.forget(event_id)
        key = token(tenant_id, run_id)
        self._expected[event_id] = (key, self._add(key))
        while len(self._expected) > EXPECTED_KEPT:
            _, (old_key, old) = self._expected.popitem(last=False)
            self._discard(old_key, old)

    def forget(self, event_id: str) -> None:
        """Stop expecting ``event_id`` (its publish failed)."""
        expected = self._expected.pop(event_id, None)
        if expected is not None:
            self._discard(*expected)

    @contextlib.asynccontextmanager
    async def watch(
        self, tenant_id: str, run_id: str, event_id: str | None = None
    ) -> AsyncIterator[tuple[asyncio.Event, bool]]:
        """An event set whenever a batch that touched the run commits, and whether the
        run was watched since before ``event_id`` was published, on this connection
        still alive (:meth:`expect`): then a commit of it cannot have been missed."""
        key = token(tenant_id, run_id)
        expected = self._expected.pop(event_id, None) if event_id is not None else None
        early = expected is not None and expected[0] == key and self.alive
        if expected is not None and early:
            woke = expected[1]
            self.early += 1
        else:
            if expected is not None:
                self._discard(*expected)  # another run's, or watched on a lost connection
            woke = self._add(key)
        try:
            yield woke, early
        finally:
            self._discard(key, woke)

    def _add(self, key: str) -> asyncio.Event:
        woke = asyncio.Event()
        self._watchers.setdefault(key, set()).add(woke)
        return woke

    def _discard(self, key: str, woke: asyncio.Event) -> None:
        watchers = self._watchers.get(key)
        if watchers is not None:
            watchers.discard(woke)
            if not watchers:
                del self._watchers[key]

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        for woke in self._watchers.get(payload, ()):
            woke.set()
            self.wakeups += 1

    def _lost(self, _conn: Any) -> None:
        self.alive = False
        for watchers in self._watchers.values():
            for woke in watchers:
                woke.set()  # re-read now, then poll

    async def close(self) -> None:
        self.alive = False
        with contextlib.suppress(Exception):
            await self._conn.close(timeout=5)
