"""Every benchmark in one run: ALMA Stream side by side with its peers, the cost
curves, and the scaling trend over checkpointer processes.

    python -m bench [--quick | --full | --smoke] [--reps N] [--only SUITE,...]
                    [--out docs/benchmarks.md]

Suites: peers, curves, scaling, temporal, langgraph, replay, retention, cache, quality, ui,
hop, tracing, tenants
(all by default), and, only when named, soak (`--only soak`, 30 minutes; 5 with --quick;
--soak-seconds and --window-seconds set its length), round-trips (the checkpointer's
first round trip as one statement against three, issue 54) and unlocked (its batch read
without locks and written in one checked statement, against a transaction under locks).

Brings up the embedded stack (PostgreSQL with fsync on) or uses the services
named by ALMA_KAFKA_BOOTSTRAP, ALMA_POSTGRES_DSN and ALMA_REDIS_URL, shows one
progress bar, prints the tables and, with --out, writes them as markdown into
their sections of docs/benchmarks.md, as JSON into docs/benchmarks.json, and the
curves as PNGs into docs/img/. Each figure is the median of --reps repetitions
with the lowest and highest beside it. --quick takes about 3 minutes on 2 cores;
the default about 15; --full adds the 10M-checkpoint and 1M-memory points.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench import (
    cache,
    curves,
    hop,
    langgraph,
    merges,
    peers,
    plots,
    quality,
    replay,
    retention,
    round_trips,
    run_state,
    scaling,
    soak,
    temporal,
    tenants,
    tracing,
    ui,
)
from bench.env import Env, services_versions, stack
from bench.report import Section, console, machine, write

SUITES = (
    "peers",
    "curves",
    "scaling",
    "temporal",
    "langgraph",
    "replay",
    "retention",
    "cache",
    "quality",
    "ui",
    "hop",
    "tracing",
    "tenants",
)
ON_REQUEST = ("soak", "round-trips", "unlocked")  # run only when named


SINGLE_MODULE_SUITES: dict[str, Callable[[Env, Section], Awaitable[None]]] = {
    "scaling": scaling.run,
    "temporal": temporal.run,
    "langgraph": langgraph.run,
    "retention": retention.run,
    "replay": replay.run,
    "cache": cache.run,
    "quality": quality.run,
    "ui": ui.run,
    "hop": hop.run,
    "tracing": tracing.run,
    "tenants": tenants.run,
    "round-trips": round_trips.run,
    "unlocked": round_trips.run_unlocked,
}


def steps(env: Env, only: set[str], length: soak.Length) -> int:
    n = length.steps if "soak" in only else 0
    if "peers" in only:
        n += 4 * env.reps + 3 * env.reps + 2 + 2 * env.reps + 1
    if "curves" in only:
        n += 2 + curves.steps(env)
    if "scaling" in only:
        n += len(scaling.PROCESSES)
    if "temporal" in only:
        n += temporal.STEPS_PER_REP * env.reps
    if "langgraph" in only:
        n += langgraph.STEPS_PER_REP * env.reps
    if "replay" in only:
        n += replay.STEPS_PER_REP * env.reps
    if "retention" in only:
        n += retention.STEPS_PER_REP * env.reps
    if "cache" in only:
        n += cache.STEPS_PER_REP * env.reps
    if "quality" in only:
        n += quality.STEPS_PER_REP
    if "ui" in only:
        n += ui.STEPS_PER_REP * env.reps
    if "hop" in only:
        n += len(hop._waits(env)) * hop.STEPS_PER_WAIT
    if "tracing" in only:
        n += len(tracing.MODES)
    if "tenants" in only:
        n += tenants.STEPS_PER_REP * env.reps
    n += round_trips.STEPS * len({"round-trips", "unlocked"} & only)
    return n


async def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(",")) if args.only else set(SUITES)
    if unknown := only - set(SUITES) - set(ON_REQUEST):
        console.print(f"[red]unknown suite(s) {sorted(unknown)}; choose from {SUITES + ON_REQUEST}")
        return 2
    length = soak.Length.of(args.quick, args.soak_seconds, args.window_seconds, args.up_setting)
    args.quick = args.quick or args.smoke
    reps = 1 if args.smoke else args.reps or (2 if args.quick else 3)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full" if args.full else "default"
    label = f"{mode}, {reps} repetitions"
    started = time.perf_counter()
    columns = (
        TextColumn("{task.description:<44}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )

    def named(base: str, broker: str = args.broker) -> Section:
        """A suite's section; on Apache Kafka its own (``peers-kafka``), beside Tansu's."""
        return Section(base if broker == "tansu" else f"{base}-{broker}")

    soak_broker = dict(s.partition("=")[::2] for s in args.up_setting).get(
        "ALMA_EMBEDDED_BROKER", args.broker
    )
    with Progress(*columns, console=console) as progress:
        async with stack(args.quick, reps, args.full, progress, args.broker) as env:
            env.smoke = args.smoke
            progress.update(env.task, total=steps(env, only, length))
            m = machine(await services_versions(env))
            # Each suite is written as soon as it ends: a later failure keeps it.
            if "peers" in only:
                side = named("peers")
                await peers.run(env, side)
                await run_state.run(env, side)
                merges.run(env, side, curves=None)
                peers.notes(side, env.broker_kind)
                write([side], m, args.out, label)
            if "curves" in only:
                cost = named("curves")
                merges.run(env, None, curves=cost)
                await curves.run(env, cost)
                write([cost], m, args.out, label)
            # suites of one module each: its run(env, section)
            for name, suite in SINGLE_MODULE_SUITES.items():
                if name in only:
                    section = named(name)
                    await suite(env, section)
                    write([section], m, args.out, label)
            if "soak" in only:
                section = named("soak", soak_broker)
                await soak.run(env, section, length)
                write([section], m, args.out, label)
    if args.out is not None:
        for png in plots.draw(args.out.with_suffix(".json"), args.out.parent / "img"):
            console.print(f"plotted {png}")
    console.print(f"all benchmarks in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer samples and points")
    parser.add_argument("--full", action="store_true", help="add the largest table sizes")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the least run that writes every table (--quick, one repetition, a quarter "
        "of its samples): checks the benchmarks run, its figures mean little",
    )
    parser.add_argument("--reps", type=int, default=0, help="repetitions per figure")
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of {SUITES + ON_REQUEST}"
    )
    parser.add_argument("--soak-seconds", type=float, default=0, help="the soak's length")
    parser.add_argument("--window-seconds", type=float, default=0, help="the soak's window")
    parser.add_argument(
        "--up-setting",
        action="append",
        default=[],
        metavar="ALMA_X=VALUE",
        help="a setting of the soak's `alma up` (repeatable): a lever to measure",
    )
    parser.add_argument(
        "--broker",
        choices=("tansu", "kafka"),
        default="tansu",
        help="the embedded broker the suites run on (the soak: --up-setting "
        "ALMA_EMBEDDED_BROKER=kafka); ALMA_KAFKA_BOOTSTRAP: a broker of one's own",
    )
    parser.add_argument("--out", type=Path, help="markdown file (JSON and PNGs beside it)")
    sys.exit(asyncio.run(main(parser.parse_args())))
