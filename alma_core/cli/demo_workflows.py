"""``alma demo``: realistic workflows through the SDK on a running stack, to see every
part of ALMA Stream at work: sequential nodes, fan-out/fan-in joins with reducers,
failures and retries, an orchestrator crash and resume, concurrent run-state writers,
optimistic locking, several tenants, then learning and scoped retrieval."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from alma_core import errors
from alma_core.memory import MemorySlice
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.dag import (
    Node,
    NodeFn,
    Orchestrator,
    Parallel,
    RunResult,
    SimulatedCrash,
    Workflow,
)
from alma_core.sdk.hooks import WorkflowHooks
from alma_core.sdk.run_state import RunState
from alma_core.storage import runs
from alma_core.types import RetrievalScope, WorkflowContext

TENANTS = ("acme", "globex", "initech")
TOPICS = (
    "solid-state batteries",
    "grid storage pricing",
    "heat pumps in cold climates",
    "carbon capture costs",
    "offshore wind supply chains",
)


class TransientError(Exception):
    """A flaky dependency: the first attempt fails, a retry succeeds."""


class UpstreamTimeout(Exception):
    """A dependency that stays down: the run fails."""


def _node(
    id_: str,
    make: Callable[[dict[str, Any], int], dict[str, Any]],
    *,
    retries: int = 0,
    pause: float = 0.0,
) -> Node:
    async def fn(state: dict[str, Any], attempt: int) -> dict[str, Any]:
        await asyncio.sleep(pause)  # the node's work
        return make(state, attempt)

    return Node(id_, fn, retries)


def research(flaky: bool, broken: bool) -> Workflow:
    """plan → three searches in parallel (sources appended, tokens summed, best
    confidence kept) → draft (flaky: fails once, retried) → review (broken: fails)."""

    def search(name: str) -> Node:
        return _node(
            f"search-{name}",
            lambda s, a: {
                "sources": [f"{name}:{s.get('topic')}"],
                "tokens": 300 + len(name) * 10,
                "confidence": round(0.5 + len(name) / 20, 2),
            },
        )

    def draft(state: dict[str, Any], attempt: int) -> dict[str, Any]:
        if flaky and attempt == 1:
            raise TransientError("rate limited by the model provider (429)")
        return {
            "draft": f"report on {state.get('topic')} from {len(state.get('sources', []))} sources",
            "tokens": 900,
        }

    def review(state: dict[str, Any], attempt: int) -> dict[str, Any]:
        if broken:
            raise UpstreamTimeout("citation checker timed out after 30s")
        return {"approved": True}

    return Workflow(
        "research-report",
        [
            _node("plan", lambda s, a: {"plan": ["search", "draft", "review"], "tokens": 120}),
            Parallel("gather", {b: [search(b)] for b in ("web", "papers", "news")}),
            _node("draft", draft, retries=1),
            _node("review", review),
        ],
        reducers={"sources": "append", "tokens": "sum", "confidence": "max"},
    )


def invoices(checks: NodeFn) -> Workflow:
    """extract → validate → ``checks`` (the run's state written by concurrent workers) →
    approve: all before the run completes, which then takes no more writes."""
    return Workflow(
        "invoice-approval",
        [
            _node("extract", lambda s, a: {"lines": 12, "total": 1840.5}),
            _node("validate", lambda s, a: {"valid": True}),
            Node("checks", checks),
            _node("approve", lambda s, a: {"approved_by": "policy-bot"}),
        ],
    )


@dataclass
class DemoReport:
    runs: list[RunResult] = field(default_factory=list)
    merge_seconds: list[float] = field(default_factory=list)
    checkpoint_seconds: list[float] = field(default_factory=list)
    resume_seconds: list[float] = field(default_factory=list)
    stale_writes_refused: int = 0
    concurrent_increments: tuple[int, int] = (0, 0)  # (sent, counted)
    retrieval: MemorySlice | None = None
    counts: dict[str, int] = field(default_factory=dict)


class Demo:
    def __init__(self, client: AlmaClient, *, runs: int, tag: str | None = None) -> None:
        self.client = client
        self.runs = runs
        self.tag = tag or uuid.uuid4().hex[:6]
        self.report = DemoReport()
        self.hooks = WorkflowHooks(client)  # one orchestrator process for the runs
        self.orch = Orchestrator(self.hooks)

    def _ctx(self, tenant: str, workflow: str, i: int) -> WorkflowContext:
        return WorkflowContext(tenant, workflow, "v1", f"demo-{self.tag}-{workflow}-{i}")

    async def one(self, i: int) -> RunResult:
        """Run ``i`` of the demo: its kind is fixed by ``i`` (so every feature shows)."""
        tenant = TENANTS[i % len(TENANTS)]
        if i % 5 == 4:
            return await self._invoice(i, tenant)
        wf = research(flaky=i % 3 == 1, broken=i % 6 == 3)  # broken: tenant acme only
        ctx = self._ctx(tenant, wf.id, i)
        task = f"research report on {TOPICS[i % len(TOPICS)]}"
        start = {"topic": TOPICS[i % len(TOPICS)]}
        if i % 6 != 2:
            return await self.orch.run(wf, ctx, task=task, state=start)
        # an orchestrator process dies after the join; a new one resumes the run
        doomed = WorkflowHooks(self.client)
        with contextlib.suppress(SimulatedCrash):
            await Orchestrator(doomed).run(wf, ctx, task=task, state=start, crash_after="gather")
        self._collect(doomed)
        async with AlmaClient(self.client.settings) as fresh:
            hooks = WorkflowHooks(fresh)
            began = time.perf_counter()
            result = await Orchestrator(hooks).resume(wf, ctx, task=task)
            self.report.resume_seconds.append(time.perf_counter() - began)
            self._collect(hooks)
            return result

    def _collect(self, hooks: WorkflowHooks) -> None:
        self.report.checkpoint_seconds += hooks.checkpoint_seconds
        self.report.merge_seconds += hooks.merge_seconds

    async def _invoice(self, i: int, tenant: str) -> RunResult:
        """Run state written by four concurrent workers (no lost update), then a stale
        optimistic write refused, in the run's `checks` step."""
        ctx = self._ctx(tenant, "invoice-approval", i)

        async def checks(_state: dict[str, Any], _attempt: int) -> dict[str, Any]:
            state = RunState(self.client, ctx, counters=("checks",))
            await asyncio.gather(
                *(state.increment("checks") for _ in range(4)),
                *(state.record_action(f"worker-{w}") for w in range(4)),
            )
            sent, counted = self.report.concurrent_increments
            self.report.concurrent_increments = (
                sent + 4,
                counted + int(await state.get("checks")),
            )
            seen = state.seq
            await state.set("status", "paid")
            try:  # a writer that read before the last write
                await state.set("status", "on-hold", expected_seq=seen)
            except errors.StaleExpectedSeq:
                self.report.stale_writes_refused += 1
            return {}

        return await self.orch.run(invoices(checks), ctx, task="approve a supplier invoice")

    async def run(self, advance: Callable[[], None], concurrency: int = 4) -> DemoReport:
        gate = asyncio.Semaphore(concurrency)

        async def guarded(i: int) -> None:
            async with gate:
                self.report.runs.append(await self.one(i))
                advance()

        await asyncio.gather(*(guarded(i) for i in range(self.runs)))
        self._collect(self.hooks)
        return self.report

    async def wait_learned(self, pool: asyncpg.Pool, timeout: float) -> int:  # noqa: ASYNC109
        """Wait (bounded) until the learner has an outcome for every demo run."""
        deadline = time.monotonic() + timeout
        while True:
            n = await runs.outcomes_count(pool, f"demo-{self.tag}-%")
            if n >= self.runs or time.monotonic() > deadline:
                return n
            await asyncio.sleep(0.2)

    async def count(self, pool: asyncpg.Pool) -> dict[str, int]:
        found = await runs.counts(pool, f"demo-{self.tag}-%", list(TENANTS))
        found["dead letters"] = found.pop("dead_letters")
        return found

    async def retrieve(self) -> MemorySlice:
        ctx = WorkflowContext(TENANTS[0], "research-report")
        return await self.client.retrieve(
            "write a research report on battery storage", ctx, RetrievalScope.WORKFLOW, top_k=3
        )
