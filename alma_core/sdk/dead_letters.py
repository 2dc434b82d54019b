"""Sending a dead letter back: its record as it came (or a corrected one) to the
lifecycle topic, keyed by its run, and the letter marked replayed. What `alma dlq replay`
and the run inspector's replay button do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg

from alma_core import errors
from alma_core.schemas.decoder import Rejection, decode
from alma_core.storage import dead_letters

Send = Callable[[bytes, bytes | None], Awaitable[None]]  # (value, key) to the lifecycle topic


async def replay(
    conn: asyncpg.Connection,
    send: Send,
    letter_id: int,
    *,
    max_state_bytes: int,
    tenant_id: str | None = None,
    corrected: bytes | None = None,
    force: bool = False,
) -> None:
    """Send dead letter ``letter_id`` (of ``tenant_id``, when given) back through ``send``:
    ``corrected`` instead of its value when given. A value that would be rejected again
    is refused unless ``force``; a valid one is keyed by its run id (its partition)."""
    row = await dead_letters.original(conn, letter_id, tenant_id)
    if row is None:
        raise errors.AlmaError(f"no dead letter {letter_id}: see `alma dlq list`")
    value: bytes = corrected if corrected is not None else (row["value"] or b"")
    key: bytes | None = row["key"]
    decoded = decode(value, max_state_bytes=max_state_bytes)
    if isinstance(decoded, Rejection):
        if not force:
            raise errors.AlmaError(
                f"the value would be rejected again ({decoded.describe()}); "
                "correct it and pass --value-file, or pass --force"
            )
    else:
        key = decoded.run_id.encode()
    await send(value, key)
    await dead_letters.mark_replayed(conn, letter_id)
