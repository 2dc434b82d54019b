"""``python -m tests.cluster [--long] [--only NAME ...] [--markdown FILE]`` (``make
faults``): start the cluster of real hosts, run every fault scenario on it and print one
table: what was injected, the events acknowledged, applied, lost and doubled, the joins
answered and the replies a failover sent again, the checkpoints a PostgreSQL failover
rolled back (applied again from Kafka), the reads that returned a state PostgreSQL did
not have, the cache entries checked, and how long publishing, applying and checkpoints
as a whole waited. Needs root (network namespaces), Java and ``make kafka``'s jars."""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.cluster import hosts
from tests.cluster.cluster import cluster
from tests.cluster.scenarios import SCENARIOS, Outcome, run

COLUMNS = (
    "scenario",
    "faults injected",
    "acknowledged",
    "applied",
    "lost",
    "doubled",
    "joins",
    "replies repeated",
    "rolled back",
    "newer reads",
    "cache checked",
    "longest publish s",
    "longest wait s",
    "longest pause s",
    "flowing again s",
    "verdict",
)


def cells(o: Outcome) -> list[str]:
    v = o.verdict
    flowing = "-" if o.flowing_after_s is None else f"{o.flowing_after_s:.1f}"
    return [
        o.scenario,
        o.fault,
        str(v.acknowledged),
        str(v.applied),
        str(v.lost),
        str(v.doubled),
        str(v.joins),
        str(v.replies_repeated),
        str(o.rolled_back),
        str(o.served_newer),
        str(v.cache_entries),
        f"{v.longest_publish_s:.1f}",
        f"{v.longest_wait_s:.1f}",
        f"{o.stalled_s:.1f}",
        flowing,
        "ok" if v.ok else "; ".join(v.problems)[:200],
    ]


def markdown(outcomes: list[Outcome], started: str, took_s: float, long: bool) -> str:
    lines = [
        f"Run of {started} ({'long' if long else 'short'} form, {took_s:.0f} s, "
        f"{platform.node()}, {platform.machine()}):",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(cells(o)) + " |" for o in outcomes]
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> int:
    console = Console(width=220)
    found = hosts.problem()
    if found:
        console.print(f"[red]cannot make the cluster's hosts:[/] {found}")
        return 2
    names = args.only or list(SCENARIOS)
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    begun = time.monotonic()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="alma-cluster-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - before anything runs
        console.print(
            f"starting the cluster in {root}: 3 Kafka brokers, a PostgreSQL primary and "
            "standby (Patroni, etcd), Redis, 2 worker hosts, an orchestrator host"
        )
        async with cluster(root) as made:
            for i, name in enumerate(names, 1):
                console.print(f"[{i}/{len(names)}] {name} ...")
                outcome = await run(made, name, long=args.long)
                outcomes.append(outcome)
                console.print("    " + " · ".join(cells(outcome)[2:]))
    table = Table(title="ALMA Stream: losing a machine")
    for column in COLUMNS:
        table.add_column(column)
    for o in outcomes:
        table.add_row(*cells(o))
    console.print(table)
    if args.markdown:
        Path(args.markdown).write_text(  # noqa: ASYNC240 - at the end, nothing else runs
            markdown(outcomes, started, time.monotonic() - begun, args.long)
        )
    return 0 if all(o.verdict.ok for o in outcomes) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__)
    parser.add_argument("--long", action="store_true", help="longer faults and load")
    parser.add_argument("--only", action="append", choices=list(SCENARIOS))
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--keep", help="the cluster's data and logs go here, and stay")
    sys.exit(asyncio.run(main(parser.parse_args())))
