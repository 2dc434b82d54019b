"""An orchestrator host: runs publish their nodes' checkpoints with the SDK, and every
event the broker acknowledged is written down (one JSON line each, flushed at once), so
the checker knows what ALMA owes whatever happens to this process afterwards.

Run in a host of the cluster: ``python -m tests.cluster.orchestrator OUT RUNS SECONDS
RATE``, with the ``ALMA_`` settings in the environment. Each run sends one
``node.completed`` after another (``updates`` folded with ``append`` into ``history``,
so an event applied twice or lost shows in the state); a send that fails (the broker
is failing over) is sent again with the same ``event_id``, as an orchestrator retries,
and the retries are counted. It stops after ``SECONDS`` (or on SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import IO

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.settings import load
from alma_core.types import WorkflowContext

TENANT, WORKFLOW = "acme", "ha"
SEND_TIMEOUT_S = 30.0


async def one_run(
    client: AlmaClient, run: str, until: float, period: float, out: IO[str], tally: dict[str, int]
) -> None:
    step = 0
    while time.monotonic() < until:
        ctx = WorkflowContext(TENANT, WORKFLOW, None, run, f"n{step}")
        event_id = f"{run}-{step}"
        sent_at, first_try = time.monotonic(), time.time()
        while True:
            try:
                await asyncio.wait_for(
                    client.node_completed(
                        ctx, updates={"step": step, "history": [step]}, event_id=event_id
                    ),
                    SEND_TIMEOUT_S,
                )
                break
            except (errors.AlmaError, TimeoutError, OSError) as exc:
                tally["retries"] += 1
                print(f"{run} step {step}: {exc!r}; sending again", file=sys.stderr, flush=True)
                await asyncio.sleep(0.5)
        acked_at = time.time()
        doc = {
            "run": run,
            "step": step,
            "event_id": event_id,
            "at": acked_at,
            "publish_s": round(acked_at - first_try, 4),  # the orchestrator's wait
        }
        out.write(json.dumps(doc) + "\n")
        out.flush()
        tally["acked"] += 1
        step += 1
        await asyncio.sleep(max(0.0, period - (time.monotonic() - sent_at)))


async def main(out_path: Path, runs: int, seconds: float, rate: float) -> None:
    settings = load()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tally = {"acked": 0, "retries": 0}
    until = time.monotonic() + seconds
    period = runs / rate  # each run's share of the rate
    prefix = f"o{int(time.time() * 1000) % 10**8}"
    with out_path.open("a") as out:
        async with AlmaClient(settings) as client:
            tasks = [
                asyncio.create_task(
                    one_run(client, f"{prefix}-r{i:02d}", until, period, out, tally)
                )
                for i in range(runs)
            ]
            publishing = asyncio.gather(*tasks)
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait([publishing, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not publishing.done():
                publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publishing  # a run's failure is raised here
    print(json.dumps(tally), flush=True)


if __name__ == "__main__":
    path, count, secs, per_s = sys.argv[1:5]
    asyncio.run(main(Path(path), int(count), float(secs), float(per_s)))
