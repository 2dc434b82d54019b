"""`alma replay` on the real services: runs made by the checkpointer and the joiner
replay with no difference; a reducer changed afterwards shows where each run would
differ; a replay racing new events of the same run reads one snapshot and sees none."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from alma_core.reducers import ReducerConfig
from alma_core.sdk.client import AlmaClient
from alma_core.sequencing import BLAKE3, SHA256, state_hash
from alma_core.settings import Settings
from alma_core.storage import reducer_configs
from alma_core.storage.postgres import connect
from alma_core.types import WorkflowContext
from tests.integration.harness import Worker, assert_replays_the_same
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of

TENANT, WORKFLOW = "acme", "replayed"


async def make_run(client: AlmaClient, run: str) -> None:
    """A run with an updates fold, two branches, a merge, a failure and its retry."""

    def at(node: str, branch: str | None = None) -> WorkflowContext:
        return WorkflowContext(TENANT, WORKFLOW, None, run, node, branch)

    async def done(ctx: WorkflowContext, **kw: Any) -> None:
        await client.applied(ctx, await client.node_completed(ctx, **kw))

    await done(at("plan"), state={"n": 1, "notes": ["plan"]})
    await done(at("a", "A"), updates={"n": 2, "notes": ["a"]})
    await done(at("b", "B"), updates={"n": 3, "notes": ["b"]})
    await client.merge(at("join"), branch_ids=["A", "B"])
    failed = await client.node_failed(at("check"), error_type="Timeout", message="slow")
    await client.applied(at("check"), failed)
    await done(at("check"), updates={"n": 4, "notes": ["checked"]})


def replay_cli(settings: Settings, *args: str) -> tuple[int, dict[str, Any]]:
    done = alma("replay", *args, "--tenant", TENANT, "--json", env=env_of(settings))
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


async def test_replay_verifies_runs_and_shows_a_changed_reducers_differences(
    settings: Settings,
) -> None:
    dsn = settings.postgres_dsn or ""
    runs = [f"rp-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
        sums = ReducerConfig(field_reducers={"n": "sum", "notes": "append"})
        await reducer_configs.save(conn, TENANT, WORKFLOW, sums)
    async with (
        Worker.start(settings, ("checkpointer", "joiner")),
        AlmaClient(settings) as client,
    ):
        for run in runs:
            await make_run(client, run)

        # racing: one run gets new events while it is replayed again and again
        racer = runs[0]

        async def more() -> None:
            for i in range(15):
                ctx = WorkflowContext(TENANT, WORKFLOW, None, racer, f"more-{i}")
                await client.applied(ctx, await client.node_completed(ctx, updates={"n": 1}))

        adding = asyncio.create_task(more())
        replays_done = 0
        while not adding.done() or replays_done == 0:
            assert await assert_replays_the_same(dsn, tenant=TENANT) == len(runs)
            replays_done += 1
        await adding
    assert replays_done > 1

    code, same = await asyncio.to_thread(replay_cli, settings, "--workflow", WORKFLOW)
    assert code == 0
    assert same["summary"]["same"] == len(runs)
    assert same["summary"]["different"] == 0
    assert same["summary"]["checkpoints"] == 6 * len(runs) + 15

    # the workflow's reducers changed afterwards: where would each run differ?
    async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
        maxes = ReducerConfig(field_reducers={"n": "max", "notes": "append"})
        await reducer_configs.save(conn, TENANT, WORKFLOW, maxes)
    code, changed = await asyncio.to_thread(replay_cli, settings, "--workflow", WORKFLOW)
    assert code == 1
    assert changed["summary"]["different"] == len(runs)
    for verdict in changed["runs"]:
        # the branches hold what they wrote: the merge (seq 4) is where max differs
        assert verdict["difference"] == {
            "seq": 4,
            "what": "state",
            "path": "/n",
            "stored": 6,
            "replayed": 3,
            "detail": "",
        }
    human = alma("replay", "--run", runs[1], "--tenant", TENANT, env=env_of(settings))
    assert human.returncode == 1
    assert f"{runs[1]}: differs at seq 4 (state at /n): stored 6, replayed 3" in human.stdout
    usage = alma("replay", "--tenant", TENANT, env=env_of(settings))
    assert usage.returncode == 2
    assert "choose the runs" in usage.stderr
    # issue 51, item 7: --run with --all is two choices at once; a run that is not there
    # is not "0 different"
    both = alma("replay", "--run", runs[1], "--all", "--tenant", TENANT, env=env_of(settings))
    assert both.returncode == 2
    assert "--all" in both.stderr
    typo = alma("replay", "--run", "typo", "--tenant", TENANT, env=env_of(settings))
    assert typo.returncode == 1, typo.stdout
    assert f"no run 'typo' of tenant {TENANT!r}" in typo.stderr
    none = alma("replay", "--workflow", "nope", "--tenant", TENANT, env=env_of(settings))
    assert none.returncode == 1, none.stdout
    assert "no runs chosen" in none.stderr


async def test_a_run_stored_before_hash_schemes_goes_on_in_its_own_scheme(
    settings: Settings,
) -> None:
    """A run whose hashes are SHA-256 (as every run stored before hash schemes is) keeps
    that scheme through the real checkpointer and joiner: a state equal to its head is
    still ``unchanged``, its new checkpoints, a new branch and a merge hash with SHA-256,
    and it replays the same; a new run beside it hashes with BLAKE3."""
    dsn = settings.postgres_dsn or ""
    old, new = (f"hs-{i}-{uuid.uuid4().hex[:6]}" for i in range(2))
    async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
        sums = ReducerConfig(field_reducers={"n": "sum", "notes": "append"})
        await reducer_configs.save(conn, TENANT, WORKFLOW, sums)

    def at(run: str, node: str, branch: str | None = None) -> WorkflowContext:
        return WorkflowContext(TENANT, WORKFLOW, None, run, node, branch)

    async with Worker.start(settings, ("checkpointer", "joiner")):
        async with AlmaClient(settings) as client:
            await make_run(client, old)
        # as if stored before hash schemes: every hash of the run rewritten to SHA-256
        async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT seq, state FROM checkpoints WHERE tenant_id = $1 AND run_id = $2",
                TENANT,
                old,
            )
            for row in rows:
                digest = state_hash(row["state"], SHA256)
                for table in ("checkpoints", "run_heads"):
                    await conn.execute(
                        f"UPDATE {table} SET state_hash = $4 "
                        "WHERE tenant_id = $1 AND run_id = $2 AND seq = $3",
                        TENANT,
                        old,
                        row["seq"],
                        digest,
                    )
        async with AlmaClient(settings) as client:
            head = (await client.resume(at(old, "again"))).branch_heads[None]
            same = await client.node_completed(at(old, "again"), state=head.state, wait="applied")
            effect = await client.applied(at(old, "again"), same)
            assert (effect.effect, effect.seq) == ("unchanged", head.seq)
            await client.node_completed(at(old, "more"), updates={"n": 1}, wait="applied")
            await client.node_completed(at(old, "c", "C"), updates={"n": 5}, wait="applied")
            await client.merge(at(old, "join2"), branch_ids=["C"])
            await client.node_completed(at(new, "plan"), state={"n": 1}, wait="applied")
    async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
        stored = await conn.fetch(
            "SELECT run_id, seq, kind, state, state_hash FROM checkpoints "
            "WHERE tenant_id = $1 AND run_id = ANY($2::text[]) ORDER BY run_id, seq",
            TENANT,
            [old, new],
        )
    kinds = [(r["run_id"], r["kind"]) for r in stored if r["run_id"] == new or r["seq"] > len(rows)]
    assert kinds == [(old, "node"), (old, "node"), (old, "merge"), (new, "node")]
    for row in stored:
        scheme = SHA256 if row["run_id"] == old else BLAKE3
        assert row["state_hash"] == state_hash(row["state"], scheme), row
    assert await assert_replays_the_same(dsn, tenant=TENANT) >= 2


# Issue 51, item 1: every JSON number comes back as it was sent. Each is a float or an
# int whose JSON text PostgreSQL's jsonb would change (numeric has no -0.0, writes 1e308
# as 309 digits, and 1.0 stays 1.0 but 1E+2 loses its float-ness), or an int beyond 64
# bits.
NUMBERS: dict[str, Any] = {
    "v": 1e308,
    "z": -0.0,
    "big": 10**40,
    "tiny": 5e-324,
    "small": 2.5e-7,
    "hundred": 1e2,
    "one": 1.0,
    "list": [-0.0, 1e308, -1.5e-300, 12345678901234567890],
}


def as_sent(value: Any) -> str:
    """The value's JSON text, floats by repr: -0.0 and 0.0 differ, as do 1e308 and 10**308."""
    return json.dumps(value, sort_keys=True)


async def test_every_number_comes_back_as_sent_from_the_cache_and_postgres_alike(
    settings: Settings,
) -> None:
    dsn = settings.postgres_dsn or ""
    run = f"num-{uuid.uuid4().hex[:6]}"

    def at(node: str, branch: str | None = None) -> WorkflowContext:
        return WorkflowContext(TENANT, "numbers", None, run, node, branch)

    async with (
        Worker.start(settings, ("checkpointer", "joiner")),
        AlmaClient(settings) as client,
    ):
        await client.applied(at("plan"), await client.node_completed(at("plan"), state=NUMBERS))
        await client.applied(
            at("a", "A"),
            await client.node_completed(at("a", "A"), updates={"z2": -0.0, "v2": 1e308}),
        )
        first = await client.merge(at("join"), branch_ids=["A"], join_id="j-numbers")
        # a retried join is answered from the stored reply
        again = await client.merge(at("join"), branch_ids=["A"], join_id="j-numbers")
        reader = await client.reader(TENANT)
        cached = await reader.latest(run)
        stored = await reader.get(run, 1)
    expected = dict(NUMBERS, z2=-0.0, v2=1e308)
    assert cached is not None
    assert stored is not None
    assert as_sent(stored.state) == as_sent(NUMBERS)
    assert as_sent(cached.state) == as_sent(expected)
    assert first.merged_state is not None
    assert again.merged_state is not None
    assert as_sent(first.merged_state) == as_sent(expected)
    assert as_sent(again.merged_state) == as_sent(expected)
    async with connect(dsn, max_size=1) as pool, pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT seq, state, state_hash FROM checkpoints "
            "WHERE tenant_id = $1 AND run_id = $2 ORDER BY seq",
            TENANT,
            run,
        )
        payload = await conn.fetchval(
            "SELECT payload FROM run_events WHERE tenant_id = $1 AND run_id = $2 AND node_id = 'a'",
            TENANT,
            run,
        )
    for row in rows:  # what PostgreSQL holds hashes to what was hashed when written
        assert row["state_hash"] == state_hash(row["state"]), row["seq"]
    assert as_sent(rows[-1]["state"]) == as_sent(expected)
    assert as_sent(payload["updates"]) == as_sent({"z2": -0.0, "v2": 1e308})
    code, verdict = await asyncio.to_thread(replay_cli, settings, "--run", run)
    assert code == 0, verdict
    assert verdict["summary"]["same"] == 1
