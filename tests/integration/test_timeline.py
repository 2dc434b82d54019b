"""Time travel on the real services: a run's state at any seq (per branch), the diff
between two checkpoints, a merge explained with its inputs and reducers, and a fork
(re-asked, re-delivered, refused onto a run that exists) that goes on like any run,
and a fork whose state is edited first by a JSON Patch (refused when it does not apply).
Through the SDK (``Timeline(client)``) and the command line."""

from __future__ import annotations

import asyncio
import getpass
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from alma_core import errors
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.timeline import Timeline
from alma_core.settings import Settings
from alma_core.types import WorkflowContext
from tests.integration.harness import Worker, count
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of


def cli(settings: Settings, *args: str) -> Any:
    done = alma(*args, "--tenant", "acme", "--json", env=env_of(settings))
    assert done.returncode == 0, (args, done.stderr)
    return json.loads(done.stdout)


async def test_a_runs_past_is_read_compared_explained_and_forked(
    settings: Settings, tmp_path: Path
) -> None:
    dsn = settings.postgres_dsn or ""
    run, fork = f"tt-{uuid.uuid4().hex[:8]}", f"tt-fork-{uuid.uuid4().hex[:8]}"
    ctx = WorkflowContext("acme", "research", None, run)

    def node(name: str, branch: str | None = None) -> WorkflowContext:
        return WorkflowContext("acme", "research", None, run, name, branch)

    async with (
        Worker.start(settings, ("checkpointer", "joiner")),
        AlmaClient(settings) as client,
    ):
        step = Timeline(client)

        async def done(c: WorkflowContext, **kw: Any) -> int | None:
            applied = await client.applied(c, await client.node_completed(c, **kw))
            return applied.seq

        assert await done(node("plan"), state={"topic": "heat", "notes": ["plan"], "n": 1}) == 1
        assert await done(node("a", "A"), updates={"notes": ["a"], "n": 2}) == 2
        assert await done(node("b", "B"), updates={"notes": ["b"], "n": 3}) == 3
        assert await done(node("a2", "A"), updates={"draft": "x"}) == 4
        reply = await client.merge(
            node("join"), branch_ids=["A", "B"], reducers={"notes": "append", "n": "sum"}
        )
        assert reply.checkpoint_seq == 5

        # the state at any moment, per branch
        at = await step.state_at(ctx, 3)
        assert at is not None
        assert (at.seq, at.state["n"]) == (1, 1)  # the main line had only seq 1 by then
        branch = await step.state_at(ctx, 3, "A")
        assert branch is not None
        assert (branch.seq, branch.state) == (2, {"notes": ["a"], "n": 2})
        assert await step.state_at(ctx, 1, "A") is None  # before the branch began
        # a diff by path
        changes = [c.to_doc() for c in await step.diff(ctx, 1, 5)]
        assert {"path": "/n", "kind": "changed", "before": 1, "after": 6} in changes
        assert {"path": "/notes/1", "kind": "added", "after": "a"} in changes
        assert {"path": "/draft", "kind": "added", "after": "x"} in changes
        branch_changes = [c.to_doc() for c in await step.diff(ctx, 1, 2)]
        assert branch_changes  # main line at 1 against branch A's first checkpoint
        with pytest.raises(errors.ContextError, match="has no checkpoint 9"):
            await step.diff(ctx, 1, 9)
        # the merge, field by field
        merge = (await step.merge(ctx, 5)).to_doc()
        assert merge["inputs"] == ["A@4", "B@3"]
        assert merge["before_seq"] == 1
        n = next(f for f in merge["fields"] if f["field"] == "n")
        assert n == {
            "field": "n",
            "reducer": "sum",
            "before": 1,
            "inputs": {"A@4": 2, "B@3": 3},
            "result": 6,
            "absent": [],
        }
        with pytest.raises(errors.ContextError, match="is no merge"):
            await step.merge(ctx, 4)

        # a fork from seq 3 (the main line's state then), asked three times at once
        forks = await asyncio.gather(*(step.fork(ctx, 3, fork) for _ in range(3)))
        assert {(f.event_id, f.seq) for f in forks} == {(forks[0].event_id, 1)}
        new = WorkflowContext("acme", "research", None, fork, "go-on")
        point = await client.resume(new)
        assert point.state == {"topic": "heat", "notes": ["plan"], "n": 1}
        assert point.latest is not None
        assert point.latest.metadata["forked_from"]["run_id"] == run
        # re-delivered (the same event published again): still one fork
        await client.publish(
            client.event(
                "node.completed",
                WorkflowContext("acme", "research", None, fork, "fork"),
                {"state": {"other": True}, "expected_seq": 0},
                event_id=forks[0].event_id,
            )
        )
        # the fork goes on like any run; the source is untouched
        assert await done(new, updates={"n": 10}) == 2
        sql = "SELECT count(*) FROM checkpoints WHERE tenant_id = 'acme' AND run_id = $1"
        assert await count(dsn, sql, fork) == 2
        assert await count(dsn, sql, run) == 5
        # a fork onto a run that has checkpoints is refused, naming what to do
        letters = "SELECT count(*) FROM dead_letters WHERE run_id = $1"
        before = await count(dsn, letters, fork)
        with pytest.raises(errors.StaleExpectedSeq, match="has checkpoints already"):
            await step.fork(ctx, 4, fork)
        # refused before anything is published: no dead letter in that run's record
        assert await count(dsn, letters, fork) == before
        with pytest.raises(errors.ContextError, match="nothing to fork"):
            await step.fork(WorkflowContext("acme", "research", None, "no-such-run"), 1, "z")

        # edit, then fork: a JSON Patch applied to the state it starts from, who and why kept
        edit = [
            {"op": "replace", "path": "/topic", "value": "cold"},
            {"op": "add", "path": "/notes/-", "value": "edited"},
        ]
        edited = f"{fork}-edited"
        await step.fork(ctx, 3, edited, patch=edit, note="try a colder topic", asked_by="ana")
        point = await client.resume(WorkflowContext("acme", "research", None, edited, "x"))
        assert point.state == {"topic": "cold", "notes": ["plan", "edited"], "n": 1}
        assert point.latest is not None
        lineage = point.latest.metadata["forked_from"]
        assert (lineage["patch"], lineage["note"], lineage["asked_by"]) == (
            edit,
            "try a colder topic",
            "ana",
        )
        # a patch that does not apply is refused before anything is written
        for bad, says in (
            ([{"op": "replace", "path": "/nowhere", "value": 1}], "does not apply"),
            ([{"op": "test", "path": "/topic", "value": "warm"}], "does not apply"),
            ({"op": "add"}, "a list of operations"),
            ([{"op": "replace", "path": "", "value": [1]}], "a state is an object"),
        ):
            with pytest.raises(errors.InvalidPatch, match=says):
                await step.fork(ctx, 3, f"{fork}-never", patch=bad)
        assert await count(dsn, sql, f"{fork}-never") == 0
        assert await count(dsn, letters, f"{fork}-never") == 0
        # the same from the command line: --patch FILE, --note; who asks is its login
        patch_file = tmp_path / "edit.json"
        patch_file.write_text(json.dumps([{"op": "remove", "path": "/notes"}]))
        forked = await asyncio.to_thread(
            cli, settings, "runs", "fork", run, "--seq", "3", "--as", f"{fork}-cli",
            "--patch", str(patch_file), "--note", "without notes",
        )  # fmt: skip
        assert forked["seq"] == 1
        shown = await asyncio.to_thread(cli, settings, "runs", "show", f"{fork}-cli")
        assert shown["forked_from"]["patch"] == [{"op": "remove", "path": "/notes"}]
        assert shown["forked_from"]["note"] == "without notes"
        assert shown["forked_from"]["asked_by"] == getpass.getuser()
        # the source lists its forks, newest first, with why and who
        source = await asyncio.to_thread(cli, settings, "runs", "show", run)
        listed = [(f["run_id"], f["seq"], f["patched"], f["note"]) for f in source["forks"]]
        assert listed == [
            (f"{fork}-cli", 1, True, "without notes"),  # the main line's state at seq 3
            (edited, 1, True, "try a colder topic"),
            (fork, 1, False, None),
        ]
        assert {f["total"] for f in source["forks"]} == {3}
        printed = await asyncio.to_thread(
            alma, "runs", "show", run, "--tenant", "acme", env=env_of(settings)
        )
        assert "forked 3 times:" in printed.stdout
        assert f"{edited} from seq 1, its state edited; why: try a colder topic (asked by ana)" in (
            printed.stdout
        )
        patch_file.write_text("[{not json")
        broken = await asyncio.to_thread(
            alma, "runs", "fork", run, "--seq", "3", "--as", f"{fork}-x", "--patch",
            str(patch_file), "--tenant", "acme", env=env_of(settings),
        )  # fmt: skip
        assert broken.returncode == 2
        assert "not a JSON file" in broken.stderr

    # the command line shows the same
    state = await asyncio.to_thread(
        cli, settings, "runs", "state", run, "--seq", "3", "--branch", "A"
    )
    assert state["seq"] == 2
    diff = await asyncio.to_thread(cli, settings, "runs", "diff", run, "1", "2")
    assert diff == branch_changes
    shown = await asyncio.to_thread(cli, settings, "runs", "show", fork)
    assert shown["forked_from"]["run_id"] == run
    assert shown["forked_from"]["seq"] == 1
    merged = await asyncio.to_thread(cli, settings, "runs", "merge", run, "5")
    assert merged["inputs"] == ["A@4", "B@3"]
    # what is not there is a failure (1), the same for every command; 2 is wrong usage
    env = env_of(settings)
    for args in (
        ("runs", "state", "no-such-run", "--seq", "1"),
        ("runs", "diff", "no-such-run", "1", "2"),
        ("runs", "diff", run, "1", "99"),
        ("runs", "merge", run, "1"),  # a checkpoint that is no merge
        ("runs", "fork", "no-such-run", "--seq", "1", "--as", f"z-{uuid.uuid4().hex[:6]}"),
    ):
        missing = await asyncio.to_thread(alma, *args, "--tenant", "acme", env=env)
        assert missing.returncode == 1, (args, missing.stderr)
        assert "alma " in missing.stderr, missing.stderr  # says where to look
