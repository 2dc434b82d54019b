"""An orchestrator host: runs publish their nodes' checkpoints with the SDK, and every
event the broker acknowledged is written down (one JSON line each, flushed at once), so
the checker knows what ALMA owes whatever happens to this process afterwards.

Run in a host of the cluster: ``python -m tests.cluster.orchestrator OUT RUNS SECONDS
RATE [JOINS]``, with the ``ALMA_`` settings in the environment. Each run sends one
``node.completed`` after another (``updates`` folded with ``append`` into ``history``,
so an event applied twice or lost shows in the state); a send that fails (the broker
is failing over) is sent again with the same ``event_id``, as an orchestrator retries,
and the retries are counted. ``JOINS`` more runs fan out and join, round after round:
branch ``a`` and branch ``b`` each complete a node (steps 2k and 2k+1 of ``history``),
then the run asks for their merge and waits for the reply, asking again with the same
``join_id`` when none comes (each such request is written down: a request is answered
once, so a reply beyond one per request is a repeat). It stops after ``SECONDS`` (or on
SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import IO

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.settings import load
from alma_core.types import WorkflowContext

TENANT, WORKFLOW = "acme", "ha"
SEND_TIMEOUT_S = 30.0


async def acked_send(
    client: AlmaClient, ctx: WorkflowContext, step: int, out: IO[str], tally: dict[str, int]
) -> None:
    """``step`` of ``ctx``'s run, sent until the broker acknowledges it, written down."""
    event_id = f"{ctx.run_id}-{step}"
    first_try = time.time()
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
            print(f"{ctx.run_id} step {step}: {exc!r}; sending again", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5)
    acked_at = time.time()
    doc = {
        "run": ctx.run_id,
        "step": step,
        "event_id": event_id,
        "at": acked_at,
        "publish_s": round(acked_at - first_try, 4),  # the orchestrator's wait
    }
    out.write(json.dumps(doc) + "\n")
    out.flush()
    tally["acked"] += 1


async def one_run(
    client: AlmaClient, run: str, until: float, period: float, out: IO[str], tally: dict[str, int]
) -> None:
    step = 0
    while time.monotonic() < until:
        sent_at = time.monotonic()
        await acked_send(
            client, WorkflowContext(TENANT, WORKFLOW, None, run, f"n{step}"), step, out, tally
        )
        step += 1
        await asyncio.sleep(max(0.0, period - (time.monotonic() - sent_at)))


async def join_run(
    client: AlmaClient, run: str, until: float, period: float, out: IO[str], tally: dict[str, int]
) -> None:
    """Round k: branches ``a`` and ``b`` complete steps 2k and 2k+1, then their merge."""
    main = WorkflowContext(TENANT, WORKFLOW, None, run)
    k = 0
    while time.monotonic() < until:
        for i, branch in enumerate(("a", "b")):
            sent_at, step = time.monotonic(), 2 * k + i
            ctx = replace(main, node_id=f"n{step}", branch_id=branch)
            await acked_send(client, ctx, step, out, tally)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - sent_at)))
        sent_at, first_try = time.monotonic(), time.time()
        join_id, requests = f"{run}-j{k}", 0
        while True:
            try:
                reply = await client.merge(
                    main,
                    branch_ids=["a", "b"],
                    join_id=join_id,
                    node_id=f"j{k}",
                    timeout=SEND_TIMEOUT_S,
                )
                requests += 1
                break
            except errors.MergeFailed:
                raise  # an error reply: nothing here can be refused
            except errors.MergeTimeout as exc:
                requests += 1  # published, not answered in time: asked again
                tally["retries"] += 1
                print(f"{join_id}: {exc!r}; asking again", file=sys.stderr, flush=True)
            except (errors.AlmaError, TimeoutError, OSError) as exc:
                tally["retries"] += 1  # not published: sent again
                print(f"{join_id}: {exc!r}; sending again", file=sys.stderr, flush=True)
                await asyncio.sleep(0.5)
        acked_at = time.time()
        doc = {
            "run": run,
            "join_id": join_id,
            "round": k,
            "requests": requests,
            "seq": reply.checkpoint_seq,
            "at": acked_at,
            "publish_s": round(acked_at - first_try, 4),
        }
        out.write(json.dumps(doc) + "\n")
        out.flush()
        tally["joins"] += 1
        k += 1
        await asyncio.sleep(max(0.0, period - (time.monotonic() - sent_at)))


async def main(out_path: Path, runs: int, seconds: float, rate: float, joins: int) -> None:
    settings = load()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tally = {"acked": 0, "joins": 0, "retries": 0}
    until = time.monotonic() + seconds
    period = (runs + joins) / rate  # each run's share of the rate
    prefix = f"o{int(time.time() * 1000) % 10**8}"
    with out_path.open("a") as out:
        async with AlmaClient(settings) as client:
            tasks = [
                asyncio.create_task(
                    one_run(client, f"{prefix}-r{i:02d}", until, period, out, tally)
                )
                for i in range(runs)
            ] + [
                asyncio.create_task(
                    join_run(client, f"{prefix}-j{i:02d}", until, period, out, tally)
                )
                for i in range(joins)
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
    fanning = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    asyncio.run(main(Path(path), int(count), float(secs), float(per_s), fanning))
