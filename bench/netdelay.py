"""A TCP proxy that delays every chunk it forwards, each way: a database across a
network, for a benchmark on one machine (its kernel has no ``netem``).

    python -m bench.netdelay --to 127.0.0.1:5432 --delay-ms 0.5

prints the port it listens on, then forwards until stopped. It runs in a process of its
own, so its work is not the benchmark's. The loop's timers have a resolution of a
millisecond: ask for less and each way takes about one; :func:`measured_rtt_ms` says
what a round trip through it takes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward what ``reader`` gives, each chunk ``delay_s`` after it arrived, in order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay_s, data))
    finally:
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(ConnectionError):
            await sender
        writer.close()


async def _serve(host: str, port: int, delay_s: float) -> None:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        with contextlib.suppress(ConnectionError):
            await asyncio.gather(
                _pump(reader, up_writer, delay_s), _pump(up_reader, writer, delay_s)
            )

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


@contextlib.asynccontextmanager
async def delayed(dsn: str, delay_ms: float) -> AsyncIterator[str]:
    """``dsn`` through a proxy in its own process that delays each way by ``delay_ms``."""
    url = urlsplit(dsn)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.netdelay",
        "--to",
        f"{url.hostname}:{url.port or 5432}",
        "--delay-ms",
        str(delay_ms),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        listening = int((await asyncio.wait_for(proc.stdout.readline(), 30)).decode())
        user = f"{url.username}@" if url.username else ""
        yield urlunsplit(url._replace(netloc=f"{user}127.0.0.1:{listening}"))
    finally:
        proc.terminate()
        await proc.wait()


async def measured_rtt_ms(dsn: str, samples: int = 50) -> float:
    """The median of ``samples`` ``SELECT 1`` round trips to ``dsn``, in ms."""
    conn = await asyncpg.connect(dsn)
    try:
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            await conn.fetchval("SELECT 1")
            times.append((time.perf_counter() - started) * 1000)
    finally:
        await conn.close()
    return statistics.median(times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--to", required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="each way")
    args = parser.parse_args()
    target_host, _, target_port = args.to.rpartition(":")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(target_host, int(target_port), args.delay_ms / 1000))
