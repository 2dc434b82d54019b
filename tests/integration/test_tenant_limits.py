"""Tenants' own limits on the real stack (issue 50, items 2 and 3).

Storage quotas: the bytes of checkpoint states a tenant keeps are counted as they are
written, exactly; at its quota a tenant's new run is refused (its events dead-lettered
as ``storage_quota``, its ``applied()`` caller told why, its join answered with the
error) while its runs begun before go on and other tenants are not held; the refused
run stays refused whatever comes after, until its letters are replayed, oldest first,
once there is room; then it is applied in order, nothing lost.

State size limits: a tenant's own limit, below the global one, holds for its states and
its merges alone, set without a restart."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from alma_core import errors
from alma_core.sdk import dead_letters as letters
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage import tenant_settings
from alma_core.types import WorkflowContext
from tests.integration.harness import Publisher, Worker, count, event, fetch, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of

QUOTA = 3_000  # bytes of states: the first run's three checkpoints take more
STATE = {"text": "x" * 1_000}


async def kept(dsn: str, tenant: str) -> tuple[int, int]:
    """The tenant's kept bytes as counted, and as its checkpoints' sizes add up."""
    counted = await count(
        dsn, "SELECT coalesce(sum(bytes), 0) FROM tenant_storage WHERE tenant_id = $1", tenant
    )
    summed = await count(
        dsn, "SELECT coalesce(sum(size_bytes), 0) FROM checkpoints WHERE tenant_id = $1", tenant
    )
    return counted, summed


async def test_a_tenant_at_its_storage_quota_begins_no_new_run_and_loses_nothing(
    settings: Settings,
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    topic = settings.lifecycle_topic
    async with AlmaClient(settings) as client:
        await client.set_tenant_settings("tight", storage_quota_bytes=QUOTA)
        async with (
            Worker.start(settings) as worker,
            Publisher(settings.kafka_bootstrap or "", topic) as pub,
        ):
            for i in range(3):  # the first run fills the quota: begun, it goes on
                await pub.send(
                    event("node.completed", "t-1", tenant="tight", state=STATE | {"i": i})
                )
            await pub.flush()

            async def first_applied() -> bool:
                sql = "SELECT count(*) FROM checkpoints WHERE run_id = 't-1'"
                return await count(dsn, sql) == 3

            await wait_for(first_applied, limit_s=60, what="t-1's three checkpoints")
            used, summed = await kept(dsn, "tight")
            assert used == summed > QUOTA  # counted exactly as written
            standing = await client.tenant_storage("tight")
            assert (standing.used, standing.quota, standing.full) == (used, QUOTA, True)

            # the checkpointer reads the tenants' storage every REFRESH_S seconds
            await asyncio.sleep(tenant_settings.REFRESH_S + 0.5)
            refused = [
                event("node.started", "t-2", tenant="tight"),
                event("node.completed", "t-2", tenant="tight", state={"step": 1}),
                event("node.completed", "t-2", tenant="tight", updates={"step": 2}),
            ]
            for doc in refused:
                await pub.send(doc)
            await pub.send(event("node.completed", "t-1", tenant="tight", state={"i": 3}))
            await pub.send(event("node.completed", "a-1", state={"a": 1}))  # acme: no quota
            await pub.flush()

            async def letters_in() -> bool:
                sql = "SELECT count(*) FROM dead_letters WHERE reason = 'storage_quota'"
                return await count(dsn, sql) == len(refused)

            await wait_for(letters_in, limit_s=60, what="t-2's three events dead-lettered")
            await wait_for(
                lambda: count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id = 'a-1'"),
                limit_s=60,
                what="acme's run applied",
            )
            begun = "SELECT count(*) FROM checkpoints WHERE run_id = 't-1'"
            assert await count(dsn, begun) == 4  # the run begun before went on
            runs = await fetch(dsn, "SELECT status, event_count FROM runs WHERE run_id = 't-2'")
            assert [(r["status"], r["event_count"]) for r in runs] == [("refused", 0)]
            assert await count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id = 't-2'") == 0

            # an applied() caller is told why; so is a join's caller, on the reply topic
            ctx = WorkflowContext("tight", "wf", None, "t-3", "n")
            with pytest.raises(errors.StorageQuotaExceeded, match="storage quota"):
                await client.node_completed(ctx, state={"a": 1}, wait="applied", timeout=60)
            with pytest.raises(errors.MergeFailed, match="storage quota"):
                await client.merge(
                    WorkflowContext("tight", "wf", None, "t-4", "join"),
                    states=[{"a": 1}, {"b": 2}],
                    timeout=60,
                )
            assert worker.value("alma_tenant_storage_bytes", {"tenant": "tight"}) >= used
            assert worker.value("alma_tenant_storage_quota_bytes", {"tenant": "tight"}) == QUOTA
            refused_total = worker.value("alma_tenant_storage_refused_total", {"tenant": "tight"})
            assert refused_total == len(refused) + 2  # t-2's, t-3's completion, t-4's join

            ids = [
                r["id"]
                for r in await fetch(
                    dsn,
                    "SELECT id FROM dead_letters WHERE run_id = 't-2' ORDER BY id",
                )
            ]
            conn = await asyncpg.connect(dsn)
            try:

                async def replay(letter: int) -> None:
                    await letters.replay(
                        conn, client.publish_record, letter, letters.ReplayChecks.of(settings)
                    )

                with pytest.raises(errors.StorageQuotaExceeded, match="refused again"):
                    await replay(ids[0])  # still at its quota
                await client.set_tenant_settings("tight", storage_quota_bytes=10 * QUOTA)
                with pytest.raises(errors.AlmaError, match=f"replay {ids[0]} first"):
                    await replay(ids[1])  # the run would begin without its first event
            finally:
                await conn.close()
            # the whole run, oldest first, from the command line
            env = env_of(settings)
            both = await asyncio.to_thread(alma, "dlq", "replay", "1", "--run", "t-2", env=env)
            assert both.returncode == 2
            assert "give a dead letter's id or --run RUN" in both.stderr
            done = await asyncio.to_thread(
                alma, "dlq", "replay", "--run", "t-2", "--tenant", "tight", env=env
            )
            assert done.returncode == 0, done.stderr
            assert f"replayed dead letters {', '.join(map(str, ids))} of run 't-2'" in done.stdout
            again = await asyncio.to_thread(
                alma, "dlq", "replay", "--run", "t-2", "--tenant", "tight", env=env
            )
            assert again.returncode != 0
            assert "has no dead letter waiting" in again.stderr

            async def reopened() -> bool:
                sql = "SELECT count(*) FROM run_events WHERE run_id = 't-2'"
                return await count(dsn, sql) == len(refused)

            await wait_for(reopened, limit_s=60, what="t-2's replayed events applied")
        rows = await fetch(
            dsn,
            "SELECT seq, state FROM checkpoints WHERE run_id = 't-2' ORDER BY seq",
        )
        assert [(r["seq"], r["state"]) for r in rows] == [
            (1, {"step": 1}),
            (2, {"step": 2}),
        ]  # in order: the replace, then the update folded onto it
        status = await fetch(dsn, "SELECT status FROM runs WHERE run_id = 't-2'")
        assert [r["status"] for r in status] == ["running"]
        used, summed = await kept(dsn, "tight")
        assert used == summed


async def test_a_tenants_own_state_limit_holds_for_its_states_and_merges_alone(
    settings: Settings,
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    big = {"text": "x" * 3_000}  # under the global limit (64 KB here), over small's own
    async with AlmaClient(settings) as client:
        async with Worker.start(settings, ("checkpointer", "joiner")):
            ctx = WorkflowContext("small", "wf", None, "s-1", "n")
            await client.node_completed(ctx, state=big, wait="applied", timeout=60)  # global
            await client.set_tenant_settings("small", max_state_bytes=2_048)
            await asyncio.sleep(tenant_settings.REFRESH_S + 0.5)  # the time it takes, stated
            bigger = big | {"more": 1}
            with pytest.raises(errors.StateTooLarge, match="the tenant's own limit is 2048"):
                await client.node_completed(ctx, state=bigger, wait="applied", timeout=60)
            halves = [{"a": "x" * 1_200}, {"b": "y" * 1_200}]  # each under it, merged over
            with pytest.raises(errors.MergeFailed, match="the tenant's own limit is 2048"):
                await client.merge(ctx, states=halves, timeout=60)
            acme = WorkflowContext("acme", "wf", None, "a-1", "n")  # another tenant: global
            await client.node_completed(acme, state=big, wait="applied", timeout=60)
            assert (await client.merge(acme, states=halves, timeout=60)).status == "ok"
        assert (await client.tenant_settings("small")).max_state_bytes == 2_048
    sizes = await fetch(
        dsn, "SELECT tenant_id, kind, size_bytes FROM checkpoints ORDER BY tenant_id, seq"
    )
    assert [(r["tenant_id"], r["kind"]) for r in sizes] == [
        ("acme", "node"),
        ("acme", "merge"),
        ("small", "node"),  # the one made before its limit was set
    ]
    letters = await fetch(
        dsn, "SELECT consumer, reason FROM dead_letters WHERE tenant_id = 'small' ORDER BY id"
    )
    assert [(r["consumer"], r["reason"]) for r in letters] == [
        ("checkpointer", "state_too_large"),
        ("joiner", "state_too_large"),
    ]
