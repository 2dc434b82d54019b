"""Each worker's HTTP endpoints: ``/metrics`` (Prometheus), ``/healthz`` (the
process answers) and ``/readyz`` (every consumer started and polled recently,
and PostgreSQL answers). A tiny asyncio server: nothing else to deploy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from alma_core import errors
from consumers.metrics import Metrics
from consumers.runtime import ConsumerRuntime

log = logging.getLogger("alma.http")

POLL_STALE_S = 30.0


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reasons: list[str]


async def readiness(
    runtimes: list[ConsumerRuntime], database_ok: Callable[[], Awaitable[bool]]
) -> Readiness:
    reasons = []
    now = time.monotonic()
    for runtime in runtimes:
        name = runtime.handler.name
        if not runtime.started.is_set():
            reasons.append(f"{name}: not started (joining its group)")
        elif now - runtime.last_poll > POLL_STALE_S:
            reasons.append(f"{name}: no poll for {now - runtime.last_poll:.0f} s")
    try:
        ok = await asyncio.wait_for(database_ok(), 2.0)
    except Exception:  # noqa: BLE001 - any failure is "not reachable"
        ok = False
    if not ok:
        reasons.append("postgres: not reachable")
    return Readiness(not reasons, reasons)


@contextlib.asynccontextmanager
async def serve(
    port: int,
    metrics: Metrics,
    runtimes: list[ConsumerRuntime],
    database_ok: Callable[[], Awaitable[bool]],
) -> AsyncIterator[int]:
    """Serve until the block ends; yields the port (0 asks for a free one)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            path = request.decode(errors="replace").split(" ")[1] if b" " in request else "/"
            while (await asyncio.wait_for(reader.readline(), 5)).strip():
                pass  # headers
            status, content_type, body = await respond(path.split("?")[0])
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    async def respond(path: str) -> tuple[str, str, bytes]:
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(metrics.registry)
        if path == "/healthz":
            return "200 OK", "application/json", b'{"status":"alive"}'
        if path == "/readyz":
            state = await readiness(runtimes, database_ok)
            body = json.dumps({"ready": state.ready, "reasons": state.reasons}).encode()
            return (
                ("200 OK" if state.ready else "503 Service Unavailable"),
                "application/json",
                body,
            )
        return "404 Not Found", "text/plain", b"try /metrics, /healthz or /readyz\n"

    try:
        server = await asyncio.start_server(handle, "0.0.0.0", port)
    except OSError as exc:
        raise errors.ConfigError(
            f"cannot serve /metrics on port {port}: {exc.strerror}; set ALMA_METRICS_PORT to a "
            "free port (0 picks one)"
        ) from exc
    bound = server.sockets[0].getsockname()[1]
    log.info("metrics and health", extra={"action": "http_listen", "port": bound})
    try:
        yield bound
    finally:
        server.close()
        await server.wait_closed()
