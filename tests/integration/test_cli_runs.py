"""`alma checkpoints`, `alma resume`, `alma dlq` on a populated database."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import asyncpg
import pytest

from alma_core.sdk.client import AlmaClient
from alma_core.sequencing import RUN_STATUSES
from alma_core.settings import Settings
from alma_core.storage import runs as run_reads
from alma_core.types import WorkflowContext
from tests.integration.harness import (
    Publisher,
    Worker,
    completed,
    count,
    event,
    plan_nodes,
    wait_for,
    worker_env,
)
from tests.integration.test_cli import alma


def env_of(settings: Settings) -> dict[str, str]:
    return {k: v for k, v in worker_env(settings).items() if k.startswith("ALMA_")}


async def populate(settings: Settings) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        for i in range(4):
            await pub.send(completed("cli-run", node=f"n{i}", updates={"i": i}))
        await pub.send(completed("cli-run", node="side", branch="B", updates={"b": 1}))
        await pub.send(b'{"broken": ', key=b"cli-run")
        await pub.flush()

    async def ready() -> bool:
        done = await count(dsn, "SELECT count(*) FROM checkpoints") == 5
        return done and await count(dsn, "SELECT count(*) FROM dead_letters") == 1

    await wait_for(ready, what="checkpoints and a dead letter")


@pytest.mark.smoke
async def test_checkpoints_and_resume(settings: Settings, worker: Worker) -> None:
    await populate(settings)
    env = env_of(settings)
    listed = alma("checkpoints", "cli-run", "--tenant", "acme", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    docs = json.loads(listed.stdout)
    assert [d["seq"] for d in docs] == [5, 4, 3, 2, 1]
    assert docs[0]["branch_id"] == "B"
    human = alma("checkpoints", "cli-run", "--tenant", "acme", "--limit", "2", env=env)
    assert "checkpoints of cli-run" in human.stdout
    resumed = json.loads(alma("resume", "cli-run", "--tenant", "acme", "--json", env=env).stdout)
    assert resumed["latest"]["seq"] == 5
    assert {k: v["seq"] for k, v in resumed["branch_heads"].items()} == {"": 4, "B": 5}
    assert resumed["latest"]["state"] == {"b": 1}


async def test_wrong_tenant_unknown_run_and_missing_tenant(
    settings: Settings, worker: Worker
) -> None:
    await populate(settings)
    env = env_of(settings)
    for args in (("cli-run", "--tenant", "globex"), ("no-such-run", "--tenant", "acme")):
        result = alma("checkpoints", *args, env=env)
        assert result.returncode == 1
        assert "no checkpoints for run" in result.stderr
        assert "Traceback" not in result.stderr
    missing = alma("resume", "cli-run", env=env)
    assert missing.returncode == 2  # wrong usage
    assert "a tenant is required" in missing.stderr
    assert "pass --tenant T or set ALMA_TENANT" in missing.stderr


async def test_alma_tenant_is_the_default_tenant(settings: Settings, worker: Worker) -> None:
    await populate(settings)
    env = env_of(settings)
    for tenant, runs in (("acme", ["cli-run"]), ("globex", [])):
        listed = alma("runs", "list", "--json", env=env | {"ALMA_TENANT": tenant})
        assert listed.returncode == 0, listed.stderr
        assert [r["run_id"] for r in json.loads(listed.stdout)] == runs
    # --tenant wins over ALMA_TENANT
    chosen = alma("runs", "list", "--tenant", "acme", "--json", env=env | {"ALMA_TENANT": "globex"})
    assert [r["run_id"] for r in json.loads(chosen.stdout)] == ["cli-run"]
    resumed = alma("resume", "cli-run", "--json", env=env | {"ALMA_TENANT": "acme"})
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["latest"]["seq"] == 5
    elsewhere = alma("checkpoints", "cli-run", env=env | {"ALMA_TENANT": "globex"})
    assert elsewhere.returncode == 1
    assert "of tenant 'globex'" in elsewhere.stderr


async def test_dlq_list_and_replay(settings: Settings, worker: Worker, tmp_path: Path) -> None:
    await populate(settings)
    env = env_of(settings)
    letters = json.loads(alma("dlq", "list", "--json", env=env).stdout)
    assert [d["reason"] for d in letters] == ["malformed_json"]
    letter = letters[0]["id"]
    again = alma("dlq", "replay", str(letter), env=env)
    assert again.returncode == 1
    assert "would be rejected again" in again.stderr
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps(completed("cli-run", node="fixed", updates={"fixed": True})))
    replayed = alma("dlq", "replay", str(letter), "--value-file", str(fixed), env=env)
    assert replayed.returncode == 0, replayed.stderr
    dsn = settings.postgres_dsn
    assert dsn

    async def six() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints") == 6

    await wait_for(six, what="the replayed event's checkpoint")
    letters = json.loads(alma("dlq", "list", "--json", env=env).stdout)
    assert letters[0]["replayed_at"] is not None
    twice = alma("dlq", "replay", str(letter), "--value-file", str(fixed), env=env)
    assert twice.returncode == 1
    assert "was replayed already" in twice.stderr
    assert "--force" in twice.stderr
    bad = alma("dlq", "replay", "99999", env=env)
    assert bad.returncode == 1
    assert "no dead letter 99999" in bad.stderr
    missing_file = alma("dlq", "replay", str(letter), "--value-file", "/nope.json", env=env)
    assert missing_file.returncode == 2


async def test_reducers_set_and_show(settings: Settings, tmp_path: Path) -> None:
    env = env_of(settings)
    good = tmp_path / "reducers.json"
    good.write_text(json.dumps({"reducers": {"log": "append", "n": "sum"}, "strict": True}))
    saved = alma("reducers", "set", "wf", str(good), "--tenant", "acme", env=env)
    assert saved.returncode == 0, saved.stderr
    shown = json.loads(alma("reducers", "show", "wf", "--tenant", "acme", env=env).stdout)
    assert shown == {
        "reducers": {"log": "append", "n": "sum"},
        "default_reducer": "last_value",
        "strict": True,
    }
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"reducers": {"n": "median"}}))
    bad = alma("reducers", "set", "wf", str(unknown), "--tenant", "acme", env=env)
    assert bad.returncode == 2  # a wrong file is wrong usage
    assert "unknown reducer 'median'" in bad.stderr
    # ALMA_TENANT stands for --tenant; with neither, the command says what to pass
    by_env = alma("reducers", "show", "wf", env=env | {"ALMA_TENANT": "acme"})
    assert json.loads(by_env.stdout)["reducers"] == {"log": "append", "n": "sum"}
    neither = alma("reducers", "show", "wf", env=env)
    assert neither.returncode == 2
    assert "pass --tenant T or set ALMA_TENANT" in neither.stderr
    malformed = tmp_path / "malformed.json"
    malformed.write_text("{nope")
    assert (
        alma("reducers", "set", "wf", str(malformed), "--tenant", "acme", env=env).returncode == 2
    )
    other = alma("reducers", "show", "wf", "--tenant", "globex", env=env)
    assert other.returncode == 1
    assert "no reducers registered" in other.stderr


async def test_runs_list_and_show(settings: Settings, worker: Worker) -> None:
    await populate(settings)
    env = env_of(settings)
    listed = alma("runs", "list", "--tenant", "acme", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert [(r["run_id"], r["status"], r["last_seq"]) for r in runs] == [("cli-run", "running", 5)]
    assert (
        json.loads(
            alma(
                "runs", "list", "--tenant", "acme", "--status", "succeeded", "--json", env=env
            ).stdout
        )
        == []
    )
    human = alma("runs", "list", "--tenant", "acme", env=env)
    assert "cli-run" in human.stdout
    assert "runs (1)" in human.stdout
    shown = alma("runs", "show", "cli-run", "--tenant", "acme", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert [c["seq"] for c in doc["checkpoints"]] == [1, 2, 3, 4, 5]
    assert [c["branch_id"] for c in doc["checkpoints"]] == [None] * 4 + ["B"]
    assert [e["effect"] for e in doc["events"]] == ["checkpointed"] * 5
    assert doc["outcome"] is None
    assert doc["joins"] == []
    table = alma("runs", "show", "cli-run", "--tenant", "acme", env=env)
    assert "checkpoints (5)" in table.stdout
    assert "no outcome yet" in table.stdout
    # bad input: unknown run, another tenant's run, no tenant, unknown status
    for args in (
        ("runs", "show", "nope", "--tenant", "acme"),
        ("runs", "show", "cli-run", "--tenant", "globex"),
    ):
        missing = alma(*args, env=env)
        assert missing.returncode == 1
        assert "no checkpoints for run" in missing.stderr
    no_tenant = alma("runs", "list", env=env)
    assert no_tenant.returncode == 2
    assert "a tenant is required" in no_tenant.stderr
    bad_status = alma("runs", "list", "--tenant", "acme", "--status", "done", env=env)
    assert bad_status.returncode == 2
    assert "unknown status" in bad_status.stderr


async def test_a_tenants_runs_are_listed_from_the_status_index_whatever_it_holds(
    settings: Settings, worker: Worker
) -> None:
    """`alma runs list` of a tenant (no status, no workflow) lists its latest runs of
    every status in their order of activity, reading no more than ``limit`` runs of
    each status from the (tenant, status, updated_at) index: it sorted every run the
    tenant had (a sequential scan, 232 ms at a million runs). The statuses it merges
    are every status the runs table allows."""
    dsn = settings.postgres_dsn
    assert dsn
    tenant, limit = f"many-{uuid.uuid4().hex[:8]}", 20
    conn = await asyncpg.connect(dsn)
    try:
        check = await conn.fetchval(
            """SELECT pg_get_constraintdef(oid) FROM pg_constraint
               WHERE conrelid = 'runs'::regclass AND conname = 'runs_status_check'"""
        )
        assert set(re.findall(r"'(\w+)'", check)) == set(RUN_STATUSES), check
        # 3,000 runs, statuses and activity times interleaved (refused ones rare)
        await conn.execute(
            """INSERT INTO runs (tenant_id, run_id, workflow_id, status, updated_at)
               SELECT $1, 'run-' || g, 'wf',
                      CASE WHEN g % 97 = 0 THEN 'refused'
                           ELSE (ARRAY['running', 'succeeded', 'failed'])[g % 3 + 1] END,
                      now() - make_interval(secs => (g * 7919) % 3001)
               FROM generate_series(1, 3000) g""",
            tenant,
        )
        await conn.execute("ANALYZE runs")  # what autovacuum does in time
        expected = [
            r["run_id"]
            for r in await conn.fetch(
                """SELECT run_id FROM runs WHERE tenant_id = $1
                   ORDER BY updated_at DESC LIMIT $2""",
                tenant,
                limit,
            )
        ]
        listed = await run_reads.listing(
            conn, tenant_id=tenant, workflow_id=None, status=None, limit=limit
        )
        assert [r["run_id"] for r in listed] == expected
        assert {r["status"] for r in listed} >= {"running", "succeeded", "failed"}
        everything = await run_reads.listing(
            conn, tenant_id=tenant, workflow_id=None, status=None, limit=10_000
        )
        assert len(everything) == 3000
        assert len({r["run_id"] for r in everything}) == 3000
        plan = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + run_reads.listing_query(tenant, None, None),
            tenant,
            None,
            None,
            limit,
        )
    finally:
        await conn.execute("DELETE FROM runs WHERE tenant_id = $1", tenant)
        await conn.close()
    nodes = list(plan_nodes(json.loads(plan)[0]["Plan"]))
    # which runs are blocked is read from the dead letters' side (none here): a run per letter
    blocked = [n for n in nodes if n.get("Alias") == "br"]
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in blocked) == 0, blocked
    reads = [n for n in nodes if n.get("Relation Name") == "runs" and n.get("Alias") != "br"]
    assert {(n["Node Type"], n["Index Name"]) for n in reads} == {
        ("Index Scan", "runs_tenant_status")
    }, reads
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in reads) <= limit * len(RUN_STATUSES)


async def test_a_run_without_a_checkpoint_resumes_from_the_start_in_the_cli_and_the_sdk(
    settings: Settings, worker: Worker
) -> None:
    """A run with only a `node.started`: `alma resume` and `client.resume` agree that it
    starts over with an empty state, and say the run is known; a run ALMA never saw is
    an error for the command (a typo, most likely) and `status` None for the SDK."""
    dsn = settings.postgres_dsn
    assert dsn
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        await pub.send(event("node.started", "only-started", attempt=1))
        await pub.flush()

    async def recorded() -> bool:
        return await count(dsn, "SELECT count(*) FROM runs WHERE run_id = 'only-started'") == 1

    await wait_for(recorded, what="the node.started to be recorded")
    env = env_of(settings)
    human = alma("resume", "only-started", "--tenant", "acme", env=env)
    assert human.returncode == 0, human.stderr
    assert "has no checkpoint yet: it resumes from the start" in human.stdout
    doc = json.loads(alma("resume", "only-started", "--tenant", "acme", "--json", env=env).stdout)
    assert (doc["status"], doc["latest"], doc["state"]) == ("running", None, {})
    async with AlmaClient(settings) as client:
        point = await client.resume(WorkflowContext("acme", "wf", run_id="only-started"))
        assert (point.status, point.latest, point.state) == ("running", None, {})
        never = await client.resume(WorkflowContext("acme", "wf", run_id="never-seen"))
        assert (never.status, never.latest, never.state) == (None, None, {})
    unknown = alma("resume", "never-seen", "--tenant", "acme", env=env)
    assert unknown.returncode == 1
    assert "no run 'never-seen' of tenant 'acme'" in unknown.stderr
    assert "starts from the beginning" in unknown.stderr
