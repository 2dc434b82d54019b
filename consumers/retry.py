"""Waiting and retrying, for the consumers and the worker: the backoff and the fetch
pace are pure decisions (:func:`backoff_delay`, :class:`FetchPacer`) the loops act on;
every wait ends early when the process is told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from alma_core import errors
from alma_core.messaging import acls

log = logging.getLogger("alma.consumers")


def backoff_delay(attempt: int, initial: float, maximum: float, jitter: float = 0.2) -> float:
    """Exponential backoff with jitter: the pure decision the retry loop acts on."""
    base = min(maximum, initial * (2 ** max(0, attempt - 1)))
    return float(base * (1 + random.uniform(-jitter, jitter)))


@dataclass
class FetchPacer:
    """How long a consumer's fetch waits at the broker: ``busy_ms`` while records come,
    ``idle_ms`` once none came for ``idle_after_s``. For a broker that does not answer
    a waiting fetch when data arrives (the embedded one): a short wait is a short hop
    under load, and costs a fetch per wait on every partition when nothing happens; the
    first record after a quiet spell waits up to ``idle_ms`` for its fetch. ``idle_ms``
    0 (or not above ``busy_ms``): always ``busy_ms``."""

    busy_ms: int
    idle_ms: int = 0
    idle_after_s: float = 2.0
    last_records: float = 0.0  # monotonic time of the last poll with records

    def wait_ms(self, now: float, got_records: bool) -> int:
        """The wait for the next fetch, after a poll at ``now``."""
        if got_records:
            self.last_records = now
        quiet = now - self.last_records >= self.idle_after_s
        return self.idle_ms if quiet and self.idle_ms > self.busy_ms else self.busy_ms


async def wait(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``, or less if ``stop`` is set first; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def retry_start(
    start: Callable[[], Awaitable[Any]],
    stop: asyncio.Event,
    what: str,
    refused: Callable[[KafkaError], errors.BrokerDenied] | None = None,
) -> bool:
    """Start a Kafka client, retrying with backoff while the broker is unreachable.
    False when ``stop`` was set first (the caller leaves quietly). A refusal by the
    broker's authorizer is not retried: waiting grants no ACL; ``refused`` says which
    one is missing."""
    attempt = 0
    while not stop.is_set():
        try:
            await start()
            return True
        except acls.REFUSALS as exc:
            raise (refused or _refused)(exc) from exc
        except KafkaError as exc:
            attempt += 1
            delay = backoff_delay(attempt, 0.5, 10.0)
            log.warning(
                "Kafka unreachable; retrying",
                extra={
                    "action": "kafka_retry",
                    "what": what,
                    "attempt": attempt,
                    "error": repr(exc),
                },
            )
            await wait(stop, delay)
    return False


def _refused(exc: KafkaError) -> errors.BrokerDenied:
    return errors.BrokerDenied(
        f"Kafka refused this client ({exc!r}): its principal lacks an ACL. What to do: "
        "grant what `alma topics acls --role worker` prints"
    )
