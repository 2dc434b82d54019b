"""A run that cannot advance says so (docs/guarantees.md §11): a running run one of whose
events was dead-lettered, the letter neither replayed nor the run advanced since, is
``blocked`` in the storage reads, the SDK's resume point, `alma runs list/show`, the
inspector's runs list, its counts and the run's page, and the ``alma_runs_blocked``
gauge; it stops being blocked when its orchestrator sends what comes next, or when the
letter is replayed and applied. On the real stack: the broker, PostgreSQL, Redis and a
worker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Any

import httpx
import pytest

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage import runs, tenant_settings
from alma_core.types import WorkflowContext
from alma_core.ui import create_app
from tests.integration.harness import Worker, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of

BIG = {"text": "x" * 3_000}  # under the suite's global state limit, over acme's own below


async def cli(settings: Settings, *args: str) -> Any:
    """``alma ARGS --json``'s document (in a thread: the worker shares this loop)."""
    done = await asyncio.to_thread(alma, *args, "--json", env=env_of(settings))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_a_run_waiting_on_its_own_dead_letter_is_blocked_until_replayed(
    settings: Settings,
) -> None:
    stuck = WorkflowContext("acme", "wf", None, "stuck-1", "plan")
    moving = WorkflowContext("acme", "wf", None, "moving-1", "plan")
    async with AlmaClient(settings) as client, Worker.start(settings) as worker:
        for ctx in (stuck, moving):
            await client.node_completed(ctx, state={"step": 1}, wait="applied", timeout=60)
        await client.set_tenant_settings("acme", max_state_bytes=2_048)
        await asyncio.sleep(tenant_settings.REFRESH_S + 0.5)  # the workers read it
        for ctx in (stuck, moving):
            draft = dataclasses.replace(ctx, node_id="draft")
            with pytest.raises(errors.StateTooLarge):
                await client.node_completed(draft, state=BIG, wait="applied", timeout=60)
        # moving's orchestrator goes on without the refused state: not blocked
        advanced = dataclasses.replace(moving, node_id="draft")
        await client.node_completed(advanced, state={"step": 2}, wait="applied", timeout=60)

        pool = await client.read_pool()
        [letter] = await runs.blocking_letters(pool, "acme", "stuck-1")
        assert letter["reason"] == "state_too_large"
        assert await runs.blocking_letters(pool, "acme", "moving-1") == []
        resumed = await client.resume(stuck)
        assert (resumed.status, resumed.blocked) == ("running", True)
        assert [(b.id, b.reason) for b in resumed.blocked_by] == [(letter["id"], "state_too_large")]
        assert not (await client.resume(moving)).blocked

        async def gauge(expected: float) -> bool:
            return worker.value("alma_runs_blocked", {"tenant": "acme"}) == expected

        await wait_for(lambda: gauge(1), limit_s=30, what="alma_runs_blocked 1")

        listed = await cli(settings, "runs", "list", "--tenant", "acme", "--status", "blocked")
        assert [(r["run_id"], r["status"]) for r in listed] == [("stuck-1", "blocked")]
        shown = await cli(settings, "runs", "show", "stuck-1", "--tenant", "acme")
        assert shown["run"]["status"] == "blocked"
        [blocker] = shown["blocked_by"]
        assert blocker["replay"] == f"alma dlq replay {letter['id']} --tenant acme"

        app = create_app(settings, tenant_header="X-Alma-Tenant", client=client)
        transport = httpx.ASGITransport(app=app)
        acme = {"X-Alma-Tenant": "acme"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1", headers=acme
        ) as http:
            page = (await http.get("/runs")).text
            counts = dict(re.findall(r'id="count-(\w+)">(\d+)<', page))
            assert (counts["running"], counts["blocked"]) == ("1", "1")
            only = (await http.get("/runs?status=blocked")).text
            assert "stuck-1" in only
            assert "moving-1" not in only
            run_page = (await http.get("/run?id=stuck-1")).text
            assert '<span class="badge blocked" id="status">blocked</span>' in run_page
            assert f"letter={letter['id']}" in run_page.split('id="run-blocked"')[1]
            other = (await http.get("/run?id=moving-1")).text
            assert 'id="run-blocked"' not in other
            assert '<span class="badge running" id="status">running</span>' in other

            # the limit raised, the letter replayed and applied: no longer blocked
            await client.set_tenant_settings("acme", max_state_bytes=60_000)
            await asyncio.sleep(tenant_settings.REFRESH_S + 0.5)
            replayed = await asyncio.to_thread(
                alma, "dlq", "replay", str(letter["id"]), "--tenant", "acme", env=env_of(settings)
            )
            assert replayed.returncode == 0, replayed.stderr

            async def unblocked() -> bool:
                return await runs.blocking_letters(pool, "acme", "stuck-1") == []

            await wait_for(unblocked, what="the replayed letter applied")
            latest = (await client.resume(stuck)).latest
            assert latest is not None
            assert latest.state == BIG
            await wait_for(lambda: gauge(0), limit_s=30, what="alma_runs_blocked 0")
            counts = dict(re.findall(r'id="count-(\w+)">(\d+)<', (await http.get("/runs")).text))
            assert (counts["running"], counts["blocked"]) == ("2", "0")
        assert await cli(settings, "runs", "list", "--tenant", "acme", "--status", "blocked") == []


async def test_a_join_refused_for_a_branch_that_never_came_blocks_its_run(
    settings: Settings,
) -> None:
    """A join is handed to the joiner (its event recorded, not applied yet); when the
    joiner refuses it (a branch it names has no checkpoint), the run waits on that
    letter like on any other, until a join that can merge is applied."""
    ctx = WorkflowContext("acme", "wf", None, "joined-1", "plan")
    async with (
        AlmaClient(settings) as client,
        Worker.start(settings, ("checkpointer", "joiner")),
    ):
        await client.node_completed(ctx, state={"n": 1}, wait="applied", timeout=60)
        branch = dataclasses.replace(ctx, node_id="search", branch_id="A")
        await client.node_completed(branch, updates={"n": 2}, wait="applied", timeout=60)
        with pytest.raises(errors.MergeFailed, match="missing_branch"):
            await client.merge(ctx, branch_ids=["A", "never"], node_id="gather", timeout=60)
        pool = await client.read_pool()
        [letter] = await wait_for(
            lambda: runs.blocking_letters(pool, "acme", "joined-1"), what="the join's letter"
        )
        assert letter["reason"] == "missing_branch"
        report = await runs.report(pool, "joined-1", "acme")
        assert report is not None
        assert report["status"] == "blocked"
        point = await client.resume(ctx)
        assert point.blocked
        # its orchestrator joins what came: merged, the run advanced, blocked no more
        await client.merge(ctx, branch_ids=["A"], node_id="gather", timeout=60)
        report = await runs.report(pool, "joined-1", "acme")
        assert report is not None
        assert (report["status"], report["blocked_by"]) == ("running", [])
