"""Telling waiters that a run's events had their effect, the moment the batch commits.

The checkpointer ends each batch transaction with one ``NOTIFY`` per run the batch
touched (recorded or dead-lettered); PostgreSQL delivers it when, and only if, the
transaction commits. ``AlmaClient.applied`` (and so ``RunState``) listens on one
connection of its own and re-reads the run's effect when its run is named, instead of
polling on a back-off (which cost up to its pause after the commit: ~20 ms of a 13 ms
hop). A notification names a run by a hash of (tenant, run id), so a listener learns no
tenant's identifiers. Notifications are a hint: a waiter still reads PostgreSQL, and
still re-reads every ``POLL_S`` if a notification is lost (its connection dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import asyncpg

CHANNEL = "alma_effects"
POLL_S = 1.0  # a waiter's re-read while notifications arrive (a safety net only)


def token(tenant_id: str, run_id: str) -> str:
    """What a notification carries for a run: no identifiers in clear."""
    return hashlib.sha256(f"{tenant_id}\x00{run_id}".encode()).hexdigest()[:32]


def tokens(runs: Iterable[tuple[str, str]]) -> list[str]:
    """The notifications for these (tenant, run id) pairs, each once, in a fixed order."""
    return sorted({token(t, r) for t, r in runs})


# One notification per token, as a statement's main query (the checkpointer's batch
# write ends with it: no round trip of its own).
NOTIFY = "SELECT pg_notify({channel}, t) FROM unnest({tokens}::text[]) AS t"


async def announce(conn: asyncpg.Connection, runs: Iterable[tuple[str, str]]) -> None:
    """Inside the batch transaction: name each run to the listeners on commit."""
    named = tokens(runs)
    if named:
        await conn.execute(NOTIFY.format(channel="$1", tokens="$2"), CHANNEL, named)


class EffectListener:
    """One LISTEN connection; ``watch(tenant, run)`` gives an event set whenever a
    batch that touched the run commits. ``alive`` is False once the connection is
    gone (waiters then poll, and the owner may open a new listener)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self.alive = True
        self.wakeups = 0  # notifications that woke a waiter

    @classmethod
    async def open(cls, dsn: str) -> EffectListener:
        conn = await asyncpg.connect(dsn)
        listener = cls(conn)
        conn.add_termination_listener(listener._lost)
        await conn.add_listener(CHANNEL, listener._notified)
        return listener

    @contextlib.asynccontextmanager
    async def watch(self, tenant_id: str, run_id: str) -> AsyncIterator[asyncio.Event]:
        key = token(tenant_id, run_id)
        woke = asyncio.Event()
        self._watchers.setdefault(key, set()).add(woke)
        try:
            yield woke
        finally:
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
