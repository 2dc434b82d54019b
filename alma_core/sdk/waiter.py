"""Waiting for an event's effect (read-your-writes): :meth:`EffectWaiter.applied`
returns once the checkpointer has had the event's effect, woken by the commit's
notification on a LISTEN connection of its own (docs/checkpointer.md, "Waiting for
an effect"), else polling PostgreSQL on a back-off."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import asyncpg

from alma_core import errors
from alma_core.logs import redact
from alma_core.sdk.reads import ReadConnections
from alma_core.storage import effects, runs
from alma_core.storage.effects import EffectListener
from alma_core.types import WorkflowContext

log = logging.getLogger("alma.sdk")


@dataclass(frozen=True)
class Applied:
    """What the checkpointer did with one event: ``checkpointed`` (at ``seq``),
    ``unchanged`` (same state as the head at ``seq``), ``recorded`` or ``handed_off``."""

    event_id: str
    effect: str
    seq: int | None


class EffectWaiter:
    def __init__(self, reads: ReadConnections) -> None:
        self.reads = reads
        self._opening = asyncio.Lock()
        self._listener: EffectListener | None = None

    @property
    def listening(self) -> EffectListener | None:
        """The LISTEN connection when open and alive (a publisher registers the events
        it sends on it, so their waits need no first read); None otherwise."""
        listener = self._listener
        return listener if listener is not None and listener.alive else None

    async def listen(self) -> EffectListener | None:
        """The LISTEN connection (opened on first use, reopened when lost); None when
        the workers do not notify or it cannot be opened (waits then poll)."""
        settings = self.reads.settings
        if not settings.notify_effects:
            return None  # the workers do not notify: poll
        async with self._opening:
            if self._listener is not None and self._listener.alive:
                return self._listener
            if self._listener is not None:
                await self._listener.close()
                self._listener = None
            try:
                assert settings.postgres_dsn is not None  # the reads' pool checked it
                self._listener = await EffectListener.open(settings.postgres_dsn)
            except (OSError, asyncpg.PostgresError) as exc:
                log.warning(
                    "cannot listen for effects (%s); applied() polls PostgreSQL instead",
                    redact(str(exc)),
                )
            return self._listener

    async def applied(
        self,
        ctx: WorkflowContext,
        event_id: str,
        *,
        timeout: float = 30.0,  # noqa: ASYNC109 - the SDK's documented parameter
    ) -> Applied:
        """Wait until the checkpointer has had ``event_id``'s effect. Raises the event's
        rejection (e.g. StaleExpectedSeq) if it was dead-lettered, and EffectTimeout if
        neither happened in ``timeout`` seconds."""
        if not (ctx.tenant_id and ctx.run_id):
            raise errors.ContextError("applied() needs the run's tenant_id and run_id")
        pool = await self.reads.pool()
        listener = await self.listen()
        deadline = time.monotonic() + timeout
        pause = 0.005
        # watching before the first read: a commit in between still wakes it
        watching = (
            listener.watch(ctx.tenant_id, ctx.run_id, event_id)
            if listener is not None
            else contextlib.nullcontext((None, False))
        )
        async with watching as (woke, early):
            # watched since before its publish (the publisher expected it): its commit
            # cannot have been missed, so the first read waits for the notification
            read = not early
            while True:
                if read:
                    if woke is not None:
                        woke.clear()  # before the read: a commit during it wakes the wait
                    found = await runs.effect_of(pool, event_id, ctx.tenant_id, ctx.run_id)
                    if found is not None and found.rejected is not None:
                        reason, detail = found.rejected
                        raise errors.rejection(reason, f"event {event_id}: {detail}")
                    if found is not None:
                        return Applied(event_id, found.effect or "", found.checkpoint_seq)
                read = True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.EffectTimeout(
                        f"event {event_id} of run {ctx.run_id!r} had no effect within "
                        f"{timeout:g} s. It is published and may still take effect, once a "
                        "checkpointer applies it: call applied() again with this event id to "
                        "know (never publish it again under a new id). Check that the "
                        "checkpointer runs (`alma up`) and is not lagging (alma_consumer_lag "
                        "on /metrics)"
                    )
                if woke is not None and listener is not None and listener.alive:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woke.wait(), min(left, effects.POLL_S))
                else:  # no notifications: poll on a back-off
                    await asyncio.sleep(min(left, pause))
                    pause = min(0.1, pause * 2)

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
