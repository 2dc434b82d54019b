"""Sending a dead letter back: its record as it came (or a corrected one) to the
lifecycle topic (with ALMA_TENANT_TOPICS, its tenant's: the one it was read from, so
a letter is checked again as that tenant's and can never be laundered into another's),
keyed by its run, and the letter marked replayed. What `alma dlq replay`
and the run inspector's replay button do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg

from alma_core import errors
from alma_core.schemas.decoder import Rejection, decode
from alma_core.sequencing import refused_now
from alma_core.storage import dead_letters
from alma_core.tenancy import TenantTopics

Send = Callable[[str, bytes, bytes | None], Awaitable[None]]  # (topic, value, key)


async def replay(
    conn: asyncpg.Connection,
    send: Send,
    letter_id: int,
    *,
    topics: TenantTopics,
    max_state_bytes: int,
    tenant_id: str | None = None,
    corrected: bytes | None = None,
    force: bool = False,
) -> None:
    """Send dead letter ``letter_id`` (of ``tenant_id``, when given) back through ``send``:
    ``corrected`` instead of its value when given, keyed by its run id (its partition).
    Refused, unless ``force``: a letter replayed already (twice would send the event
    twice; two asking at once, one is refused), and a value that would be rejected
    again, by the decoder or by its run as it stands now (completed, or at another seq
    than the event's ``expected_seq``)."""
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
        owner: str | None = row["tenant_id"]
        topic = topics.lifecycle_for(owner) if topics.per_tenant and owner else topics.lifecycle
        decoded = decode(value, max_state_bytes=max_state_bytes)
        if topics.per_tenant:
            decoded = topics.bind(topic, decoded)
        if isinstance(decoded, Rejection):
            if not force:
                raise errors.AlmaError(
                    f"the value would be rejected again ({decoded.describe()}); "
                    "correct it and pass --value-file, or pass --force"
                )
        else:
            key = decoded.run_id.encode()
            run = await dead_letters.run_standing(conn, decoded.tenant_id, decoded.run_id)
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
