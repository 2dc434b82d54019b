"""Waiting and retrying, for the consumers and the worker: the backoff is a pure
decision (:func:`backoff_delay`) the loops act on; every wait ends early when the
process is told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka.errors import KafkaError

log = logging.getLogger("alma.consumers")


def backoff_delay(attempt: int, initial: float, maximum: float, jitter: float = 0.2) -> float:
    """Exponential backoff with jitter: the pure decision the retry loop acts on."""
    base = min(maximum, initial * (2 ** max(0, attempt - 1)))
    return float(base * (1 + random.uniform(-jitter, jitter)))


async def wait(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``, or less if ``stop`` is set first; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def retry_start(start: Callable[[], Awaitable[Any]], stop: asyncio.Event, what: str) -> bool:
    """Start a Kafka client, retrying with backoff while the broker is unreachable.
    False when ``stop`` was set first (the caller leaves quietly)."""
    attempt = 0
    while not stop.is_set():
        try:
            await start()
            return True
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
