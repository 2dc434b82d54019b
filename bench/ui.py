"""The run inspector's pages: how long `alma ui` takes to answer over a tenant of 100,000
runs, a run of 1,000 checkpoints and a state of 10,000 fields.

In a database of its own: 100,000 runs of one tenant (a third of them failed, a few
running, created over 30 days), one run of 1,000 checkpoints (1 KB states, 1,000 audit
rows) with its heads, and a run of two checkpoints of a 10,000-field state (the second
changing 10 fields). `alma ui --tenant bench` runs in a process of its own, as a person
starts it; each page is asked for one after another over HTTP (keep-alive), its time
measured by the client, after a few requests to warm it up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import asyncpg
import httpx

from alma_core.cli.embedded import free_port
from alma_core.ui.views import cursor
from bench.env import Env
from bench.report import Section, Stat, pct

STEPS_PER_REP = 2
TARGET_MS = 200
BIG_RUN = "inspected"
WIDE_RUN, WIDE_FIELDS = "wide", 10_000


def _sizes(env: Env) -> tuple[int, int]:
    """Runs in the tenant, checkpoints of the big run."""
    return (2_000, 100) if env.smoke else (100_000, 1_000)


async def _fill(dsn: str, runs: int, checkpoints: int) -> None:
    """The tenant's runs and the big run, in a few set-based statements."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """INSERT INTO runs (run_id, tenant_id, workflow_id, status, last_seq, event_count,
                                 created_at, updated_at, completed_at)
               SELECT 'run-' || i, 'bench', 'wf-' || (i % 7),
                      CASE WHEN i % 3 = 0 THEN 'failed' WHEN i % 50 = 1 THEN 'running'
                           ELSE 'succeeded' END,
                      5, 6, now() - make_interval(secs => i * 25.0),
                      now() - make_interval(secs => i * 25.0),
                      CASE WHEN i % 50 = 1 THEN NULL
                           ELSE now() - make_interval(secs => i * 25.0 - 20) END
               FROM generate_series(1, $1) AS i""",
            runs,
        )
        # two checkpoints of each run (what searching by node and error text reads): a
        # node, then a node or, in a failed run, a failure with its error
        await conn.execute(
            """INSERT INTO checkpoints (run_id, seq, tenant_id, kind, node_id, event_id, state,
                                        state_hash, size_bytes, metadata)
               SELECT 'run-' || i, s, 'bench',
                      CASE WHEN s = 2 AND i % 3 = 0 THEN 'failure' ELSE 'node' END,
                      'step-' || (i % 11 + s), 'run-' || i || '-' || s, '{"n": 1}'::json,
                      md5(i::text), 8,
                      CASE WHEN s = 2 AND i % 3 = 0
                           THEN jsonb_build_object('error', jsonb_build_object(
                                  'type', 'Timeout', 'message', 'upstream slow ' || i))
                           ELSE '{}'::jsonb END
               FROM generate_series(1, $1) AS i, generate_series(1, 2) AS s""",
            runs,
        )
        await conn.execute(
            """INSERT INTO runs (run_id, tenant_id, workflow_id, status, last_seq, event_count)
               VALUES ($1, 'bench', 'wf-0', 'running', $2::bigint, $2::bigint)""",
            BIG_RUN,
            checkpoints,
        )
        await conn.execute(
            """INSERT INTO checkpoints (run_id, seq, tenant_id, kind, node_id, branch_id,
                                        parent_seq, event_id, state, state_hash, size_bytes)
               SELECT $1, s, 'bench', CASE WHEN s % 97 = 0 THEN 'failure' ELSE 'node' END,
                      'node-' || (s % 13), CASE WHEN s % 4 = 0 THEN 'b' || (s % 3) END,
                      NULLIF(s - 1, 0), 'e-' || s,
                      jsonb_build_object('step', s, 'text', repeat(md5(s::text), 30)),
                      md5(s::text), 1000
               FROM generate_series(1, $2) AS s""",
            BIG_RUN,
            checkpoints,
        )
        await conn.execute(
            """INSERT INTO run_heads (tenant_id, run_id, branch_key, seq, state_hash)
               VALUES ('bench', $1, '', $2::bigint, md5($2::bigint::text))""",
            BIG_RUN,
            checkpoints,
        )
        await conn.execute(
            """INSERT INTO run_events (event_id, run_id, tenant_id, type, node_id, emitted_at,
                                       checkpoint_seq, effect, payload)
               SELECT 'e-' || s, $1, 'bench', 'node.completed', 'node-' || (s % 13), now(), s,
                      'checkpointed', '{}'::jsonb
               FROM generate_series(1, $2) AS s""",
            BIG_RUN,
            checkpoints,
        )
        # a run of two checkpoints of a 10,000-field state, the second changing 10 fields
        await conn.execute(
            """INSERT INTO runs (run_id, tenant_id, workflow_id, status, last_seq, event_count)
               VALUES ($1, 'bench', 'wf-0', 'running', 2, 2)""",
            WIDE_RUN,
        )
        await conn.execute(
            """INSERT INTO checkpoints (run_id, seq, tenant_id, kind, node_id, parent_seq,
                                        event_id, state, state_hash, size_bytes)
               SELECT $1, s, 'bench', 'node', 'wide', NULLIF(s - 1, 0), 'w-' || s,
                      (SELECT json_object_agg('field-' || k,
                                CASE WHEN s = 2 AND k % 1000 = 0 THEN 'changed ' || k
                                     ELSE 'value of ' || k END)
                       FROM generate_series(1, $2) AS k),
                      md5(s::text), 200000
               FROM generate_series(1, 2) AS s""",
            WIDE_RUN,
            WIDE_FIELDS,
        )
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def served(environ: dict[str, str], *args: str) -> AsyncIterator[str]:
    """`alma ui ARGS` in a process of its own, with environment ``environ``, on a free
    port; its base URL once it answers (30 s at most), stopped at the end."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "alma_core.cli",
        "ui",
        "--port",
        str(port),
        *args,
        env=environ,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(300):
                if process.returncode is not None:
                    told = await process.stderr.read() if process.stderr else b""
                    raise RuntimeError(f"alma ui exited: {told.decode(errors='replace')}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{base}/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("alma ui did not answer within 30 s")
        yield base
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 20)
            except TimeoutError:
                process.kill()
                await process.wait()


def _inspector(env: Env, dsn: str) -> contextlib.AbstractAsyncContextManager[str]:
    settings = env.s.model_copy(update={"postgres_dsn": dsn, "metrics_port": 0})
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ALMA_")}
    return served({**environ, **settings.to_env()}, "--tenant", "bench")


def _pages(checkpoints: int) -> list[tuple[str, str]]:
    run = f"/run?id={BIG_RUN}"
    middle = quote(cursor((datetime.now(UTC) - timedelta(days=10), "run-")))
    longer = quote(cursor((3_600_000.0, datetime.now(UTC), "run-")))  # runs over an hour
    return [
        ("runs, newest 50", "/runs"),
        ("runs, failed", "/runs?status=failed"),
        ("runs, a workflow, a page 10 days back", f"/runs?workflow=wf-3&after={middle}"),
        ("runs, run id contains", "/runs?q=run-9999"),
        ("runs, node contains (every 11th run)", "/runs?node=STEP-5"),
        ("runs, error text (one run)", "/runs?error=slow+99999"),
        ("runs, a page of newer runs", f"/runs?newer={middle}"),
        ("runs, a time range", "/runs?since=2000-01-01T00:00&until=2999-01-01T00:00"),
        ("runs, longest first", "/runs?sort=duration"),
        ("runs, by duration, a later page", f"/runs?sort=duration&after={longer}"),
        ("runs, worst status first", "/runs?sort=status"),
        ("runs, failed, shortest first", "/runs?status=failed&sort=duration&dir=asc"),
        (f"a run of {checkpoints:,} checkpoints", run),
        ("the same run's history, a later page", f"{run}&events={checkpoints // 2}"),
        ("a checkpoint", f"/checkpoint?id={BIG_RUN}&seq={checkpoints // 2}"),
        ("a diff, first to last", f"/diff?id={BIG_RUN}&a=1&b={checkpoints}"),
        ("dead letters", "/dead-letters"),
        (f"a checkpoint of a {WIDE_FIELDS:,}-field state", f"/checkpoint?id={WIDE_RUN}&seq=2"),
        ("the same, fields whose name has '99'", f"/checkpoint?id={WIDE_RUN}&seq=2&key=99"),
        ("the same, a later page of fields", f"/checkpoint?id={WIDE_RUN}&seq=2&fields=5000"),
    ]


async def _measure(base: str, pages: list[tuple[str, str]], n: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name, _ in pages}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        for _, path in pages:  # warm: the first request of each opens connections, plans
            for _ in range(3):
                (await http.get(path)).raise_for_status()
        for _ in range(n):
            for name, path in pages:
                started = time.perf_counter()
                response = await http.get(path)
                times[name].append((time.perf_counter() - started) * 1000)
                response.raise_for_status()
    return times


async def run(env: Env, section: Section) -> None:
    runs, checkpoints = _sizes(env)
    section.table(
        "ui",
        f"Run inspector pages ({runs:,} runs in the tenant, a run of {checkpoints:,} checkpoints)",
        ["page", "p50 ms", "p95 ms", f"under {TARGET_MS} ms p95"],
    )
    n = 5 if env.smoke else 40
    pages = _pages(checkpoints)
    found: dict[str, list[list[float]]] = {name: [] for name, _ in pages}
    for _ in range(env.reps):
        async with env.database("ui") as dsn:
            env.step(f"ui: {runs:,} runs, a run of {checkpoints:,} checkpoints")
            await _fill(dsn, runs, checkpoints)
            env.done()
            env.step(f"ui: {len(pages)} pages x {n}")
            async with _inspector(env, dsn) as base:
                for name, samples in (await _measure(base, pages, n)).items():
                    found[name].append(samples)
            env.done()
    worst = 0.0
    for name, _ in pages:
        p95 = Stat([pct(r, 95) for r in found[name]], 1)
        worst = max(worst, p95.median)
        section.add(
            "ui",
            [
                name,
                Stat([pct(r, 50) for r in found[name]], 1),
                p95,
                "yes" if p95.median < TARGET_MS else "no",
            ],
        )
    section.note(
        "ui",
        f"`alma ui` in a process of its own on the same 2 cores as PostgreSQL; {n} requests "
        f"of each page one after another per repetition, after 3 to warm up. From this run: "
        f"the slowest page answers in {worst:.1f} ms p95 (the target: {TARGET_MS} ms).",
    )
