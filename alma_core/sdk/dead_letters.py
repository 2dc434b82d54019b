"""Sending a dead letter back (or all of a run's, oldest first): its record as it came
(or a corrected one) to the lifecycle topic (with ALMA_TENANT_TOPICS, its tenant's: the
one it was read from, so a letter is checked again as that tenant's and can never be
laundered into another's), keyed by its run, and the letter marked replayed. What
`alma dlq replay` and the run inspector's replay button do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

from alma_core import errors
from alma_core.schemas.decoder import Decoded, Rejection, decode
from alma_core.schemas.events import Event
from alma_core.sequencing import REFUSED, refused_now
from alma_core.settings import Settings
from alma_core.storage import dead_letters, tenant_settings
from alma_core.tenancy import TenantTopics

Send = Callable[[str, bytes, bytes | None], Awaitable[None]]  # (topic, value, key)


@dataclass(frozen=True)
class ReplayChecks:
    """What a replay checks a letter against, as the workers would: where it goes back
    (``topics``: with ALMA_TENANT_TOPICS its tenant's own), the decoder's state size
    limit and the global storage quota (ALMA_TENANT_STORAGE_QUOTA_BYTES; a tenant's own
    is read from PostgreSQL)."""

    topics: TenantTopics
    max_state_bytes: int
    storage_quota: int = 0

    @classmethod
    def of(cls, settings: Settings) -> ReplayChecks:
        return cls(
            settings.topic_names, settings.max_state_bytes, settings.tenant_storage_quota_bytes
        )


def as_sent(value: bytes, owner: str | None, checks: ReplayChecks) -> tuple[str, Decoded]:
    """Where a letter of tenant ``owner`` goes back (with ALMA_TENANT_TOPICS, its
    tenant's lifecycle topic) and what the workers will read ``value`` as there: an
    event, or the Rejection that would dead-letter it again."""
    topics = checks.topics
    topic = topics.lifecycle_for(owner) if topics.per_tenant and owner else topics.lifecycle
    decoded = decode(value, max_state_bytes=checks.max_state_bytes)
    return topic, topics.bind(topic, decoded) if topics.per_tenant else decoded


async def replay(
    conn: asyncpg.Connection,
    send: Send,
    letter_id: int,
    checks: ReplayChecks,
    *,
    tenant_id: str | None = None,
    corrected: bytes | None = None,
    force: bool = False,
) -> None:
    """Send dead letter ``letter_id`` (of ``tenant_id``, when given) back through ``send``:
    ``corrected`` instead of its value when given, keyed by its run id (its partition).
    Refused, unless ``force``: a letter replayed already (twice would send the event
    twice; two asking at once, one is refused), and a value that would be rejected
    again, by the decoder or by its run as it stands now (completed, or at another seq
    than the event's ``expected_seq``, or refused at its start while its tenant is
    still at its storage quota: ``checks``). A run refused at its start is reopened
    (its empty row deleted in the replay's transaction): replay its letters oldest
    first, and it begins again from its first event."""
    async with conn.transaction():
        row = await dead_letters.original(conn, letter_id, tenant_id, for_update=True)
        if row is None:
            raise errors.AlmaError(f"no dead letter {letter_id}: see `alma dlq list`")
        if row["replayed_at"] is not None and not force:
            raise errors.AlmaError(
                f"dead letter {letter_id} was replayed already (at "
                f"{row['replayed_at']:%Y-%m-%d %H:%M:%S %Z}): sending it again would send its "
                "event twice. What to do: nothing, or pass --force to send it once more"
            )
        value: bytes = corrected if corrected is not None else (row["value"] or b"")
        key: bytes | None = row["key"]
        topic, decoded = as_sent(value, row["tenant_id"], checks)
        if isinstance(decoded, Rejection):
            if not force:
                raise errors.AlmaError(
                    f"the value would be rejected again ({decoded.describe()}); "
                    "correct it and pass --value-file, or pass --force"
                )
        else:
            key = decoded.run_id.encode()
            run = await dead_letters.run_standing(conn, decoded.tenant_id, decoded.run_id)
            if run is not None and run["status"] == REFUSED:
                await _reopen(conn, letter_id, decoded, checks.storage_quota, force)
                run = None  # a new run again: its first event replayed first begins it
            refusal = refused_now(
                decoded,
                status=run["status"] if run else None,
                completed=bool(run and run["completed_at"] is not None),
                last_seq=run["last_seq"] if run else 0,
            )
            if refusal is not None and not force:
                raise errors.AlmaError(
                    f"the event would be refused again: {refusal.message}. What to do: "
                    "correct it (a new run id, or the run's current seq as expected_seq) "
                    "and pass --value-file, or pass --force"
                )
        await send(topic, value, key)
        await dead_letters.mark_replayed(conn, letter_id)


async def replay_run(
    conn: asyncpg.Connection,
    send: Send,
    tenant_id: str,
    run_id: str,
    checks: ReplayChecks,
    *,
    force: bool = False,
) -> list[int]:
    """Every letter of the tenant's run not replayed yet, oldest first, each as
    :func:`replay` sends one (a run refused at its storage quota is reopened by the
    first): the ids sent. Stops at the first one refused, its error naming it and those
    sent before."""
    waiting = await dead_letters.waiting_of_run(conn, tenant_id, run_id)
    if not waiting:
        raise errors.AlmaError(
            f"run {run_id!r} of tenant {tenant_id!r} has no dead letter waiting to be "
            "replayed: see `alma dlq list`"
        )
    sent: list[int] = []
    for letter in waiting:
        try:
            await replay(conn, send, letter, checks, tenant_id=tenant_id, force=force)
        except errors.AlmaError as exc:
            before = f"letters {sent} were sent before it" if sent else "none was sent before it"
            raise type(exc)(
                f"dead letter {letter} of run {run_id!r}: {exc.message} ({before})"
            ) from None
        sent.append(letter)
    return sent


async def _reopen(
    conn: asyncpg.Connection, letter_id: int, event: Event, storage_quota: int, force: bool
) -> None:
    """Delete the row of ``event``'s run, refused at its start (it holds nothing), unless
    (and not ``force``) its tenant is still at its storage quota (the event would be
    refused again) or the run has an older letter not replayed yet (the run would begin
    without its first events)."""
    tenant_id, run_id = event.tenant_id, event.run_id
    held = await tenant_settings.standing(conn, tenant_id, storage_quota)
    if held.full and not force:
        raise errors.StorageQuotaExceeded(
            f"the event would be refused again: tenant {tenant_id!r} keeps {held.used} "
            f"bytes of checkpoint states, its storage quota is {held.quota}. What to do: "
            f"raise it (alma tenants set {tenant_id} --storage-quota-bytes N) or let "
            "retention free room, then replay; or pass --force"
        )
    older = await dead_letters.older_of_run(
        conn, letter_id, tenant_id, run_id, errors.StorageQuotaExceeded.reason
    )
    if older is not None and not force:
        raise errors.AlmaError(
            f"run {run_id!r} was refused at its start and its dead letter {older} is older "
            f"and not replayed: replaying {letter_id} first would begin the run without its "
            f"first events. What to do: replay {older} first (its letters oldest first), "
            "or pass --force"
        )
    await conn.execute(
        """DELETE FROM runs WHERE tenant_id = $1 AND run_id = $2 AND status = $3
             AND event_count = 0""",
        tenant_id,
        run_id,
        REFUSED,
    )
