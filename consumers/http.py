"""Each worker's HTTP endpoints: ``/metrics`` (Prometheus), ``/healthz`` (the
process answers), ``/readyz`` (every consumer started and polled recently, and
PostgreSQL and a Kafka broker answer) and, where the learner runs, ``POST /embed`` (``{"texts":
[...]}`` → ``{"model", "dimension", "vectors"}``, at most 64 texts): the model it
holds, for retrieval elsewhere without loading it. A tiny asyncio server: nothing
else to deploy.

The server starts before anything else, so liveness answers while PostgreSQL,
Kafka or the model are still awaited (a slow dependency must not make an
orchestrator kill the process forever); readiness names what is still missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from alma_core import errors
from alma_core.consumers.runtime import ConsumerRuntime
from alma_core.logs import redact
from alma_core.storage.embeddings import MAX_SERVED_TEXTS, AsyncEmbedder

log = logging.getLogger("alma.http")

POLL_STALE_S = 30.0
MAX_BODY_BYTES = 256 * 1024


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reasons: list[str]


@dataclass
class Health:
    """What a worker's start-up has not done yet (``waiting``: part → why), then the
    running parts /readyz checks; filled in as the worker starts."""

    waiting: dict[str, str] = field(default_factory=dict)
    runtimes: list[ConsumerRuntime] = field(default_factory=list)
    # what must answer once started (part → check): PostgreSQL for a worker
    checks: dict[str, Callable[[], Awaitable[bool]]] = field(default_factory=dict)
    embedder: AsyncEmbedder | None = None


async def readiness(health: Health) -> Readiness:
    reasons = [f"{part}: {why}" for part, why in health.waiting.items()]
    if not health.checks:
        return Readiness(False, reasons or ["starting"])
    now = time.monotonic()
    for runtime in health.runtimes:
        name = runtime.handler.name
        if not runtime.started.is_set():
            reasons.append(f"{name}: not started (joining its group)")
        elif now - runtime.last_poll > POLL_STALE_S:
            reasons.append(f"{name}: no poll for {now - runtime.last_poll:.0f} s")
    for part, check in list(health.checks.items()):
        try:
            ok = await asyncio.wait_for(check(), 2.0)
        except Exception:  # noqa: BLE001 - any failure is "not reachable"
            ok = False
        if not ok:
            reasons.append(f"{part}: not reachable")
    return Readiness(not reasons, reasons)


@contextlib.asynccontextmanager
async def serve(
    port: int, registry: CollectorRegistry, health: Health, host: str = "127.0.0.1"
) -> AsyncIterator[int]:
    """Serve on ``host`` until the block ends; yields the port (0 asks for a free one)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            method, _, rest = request.decode(errors="replace").partition(" ")
            path = rest.split(" ")[0] if rest else "/"
            length, accept = 0, ""
            while line := (await asyncio.wait_for(reader.readline(), 5)).strip():
                name, _, value = line.decode(errors="replace").partition(":")
                if name.strip().lower() == "content-length" and value.strip().isdigit():
                    length = int(value.strip())
                elif name.strip().lower() == "accept":
                    accept = value
            if length > MAX_BODY_BYTES:
                # read what was sent (up to a bound) so the client gets the answer, not a reset
                await asyncio.wait_for(_discard(reader, min(length, 4 * MAX_BODY_BYTES)), 5)
                status, content_type, body = "413 Content Too Large", "text/plain", b"too large\n"
            else:
                payload = await asyncio.wait_for(reader.readexactly(length), 5) if length else b""
                status, content_type, body = await respond(
                    method, path.split("?")[0], payload, accept
                )
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, IndexError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def respond(
        method: str, path: str, payload: bytes, accept: str
    ) -> tuple[str, str, bytes]:
        if path == "/embed" and health.embedder is not None:
            return await embed(method, payload)
        if path == "/metrics" and "application/openmetrics-text" in accept:
            # what Prometheus asks for when it stores exemplars: the latency histograms'
            # trace ids, when traces are on (docs/operations.md, "Traces")
            body = openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call]
            return "200 OK", openmetrics.CONTENT_TYPE_LATEST, body
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)
        if path == "/healthz":
            return "200 OK", "application/json", b'{"status":"alive"}'
        if path == "/readyz":
            state = await readiness(health)
            reasons = [redact(r) for r in state.reasons]  # an error may quote a DSN
            body = json.dumps({"ready": state.ready, "reasons": reasons}).encode()
            return (
                ("200 OK" if state.ready else "503 Service Unavailable"),
                "application/json",
                body,
            )
        return "404 Not Found", "text/plain", b"try /metrics, /healthz, /readyz or /embed\n"

    async def embed(method: str, payload: bytes) -> tuple[str, str, bytes]:
        embedder = health.embedder
        assert embedder is not None
        if method != "POST":
            return "405 Method Not Allowed", "text/plain", b'POST {"texts": [...]}\n'
        try:
            texts = json.loads(payload)["texts"]
            if not (
                isinstance(texts, list)
                and 0 < len(texts) <= MAX_SERVED_TEXTS
                and all(isinstance(t, str) for t in texts)
            ):
                raise ValueError(f"texts: a list of 1 to {MAX_SERVED_TEXTS} strings")
        except (ValueError, KeyError, TypeError) as exc:
            return "400 Bad Request", "text/plain", f"{exc}\n".encode()
        vectors = await embedder.embed(texts)
        doc = {
            "model": embedder.embedder.name,
            "dimension": embedder.dimension,
            "vectors": vectors,
        }
        return "200 OK", "application/json", json.dumps(doc).encode()

    try:
        server = await asyncio.start_server(handle, host, port)
    except OSError as exc:
        raise errors.ConfigError(
            f"cannot serve /metrics on {host}:{port}: {exc.strerror}; set ALMA_METRICS_PORT to "
            "a free port (0 picks one), and ALMA_METRICS_HOST to an address of this machine"
        ) from exc
    bound = server.sockets[0].getsockname()[1]
    log.info("metrics and health", extra={"action": "http_listen", "host": host, "port": bound})
    try:
        yield bound
    finally:
        server.close()
        await server.wait_closed()


async def _discard(reader: asyncio.StreamReader, n: int) -> None:
    while n > 0 and (chunk := await reader.read(min(n, 65536))):
        n -= len(chunk)
