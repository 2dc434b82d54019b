"""A newcomer's first hour, walked as one: `alma demo` in a project directory (its own
stack, stopped at the end, as `make demo` does; every feature it shows checked in its
summary); its closing hint followed as printed
(`alma up` there); then, from another directory with no `ALMA_*` variable and every
output piped, each read command of the CLI, the README's shell commands and its Python
snippets (which find the running stack through the per-user registry); at last, with
the stack stopped, the error that says where it looked."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import fetch
from tests.integration.test_embedded import AlmaUp
from tests.readme_blocks import RUNNER, blocks, runnable
from tests.services import without_alma_settings


def run_as_user(
    *args: str, cwd: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """A command run as a newcomer runs it: no `ALMA_` variable, output piped."""
    env = without_alma_settings() | {"ALMA_METRICS_PORT": "0"}
    env.pop("COLUMNS", None)
    return subprocess.run(
        args,
        env=env,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def alma(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_as_user(sys.executable, "-m", "alma_core.cli", *args, cwd=cwd)


def readme_commands() -> list[list[str]]:
    """The `alma` commands the README's shell blocks show, but `alma up` (running)."""
    found = []
    for block in blocks():
        for raw in block.text.splitlines() if block.language == "bash" else []:
            words = shlex.split(raw.split("#")[0])
            if words[:1] == ["alma"] and words[1] != "up":
                found.append(words[1:])
    return found


@pytest.mark.slow
async def test_a_newcomers_first_hour(tmp_path: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()

    # `make demo`: the demo on a stack of its own, which it stops; every feature it shows
    # is checked in its summary, and the next step it prints works as printed (below)
    demo = await asyncio.to_thread(alma, "demo", "--runs", "10", "--json", cwd=project)
    assert demo.returncode == 0, demo.stderr[-3000:]
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    counts = summary["counts"]
    assert (counts["runs"], counts["outcomes"]) == (10, 10)
    assert (summary["succeeded"], summary["failed"]) == (9, 1)
    assert summary["resumed"] == 2  # runs 2 and 8 crash after the join and resume
    assert counts["joins"] == 8  # one per research run; invoices have none
    assert summary["stale_writes_refused"] == 2
    assert counts["dead letters"] == 2
    sent, counted = summary["concurrent_increments"]
    assert sent == counted == 8
    assert summary["retrieval"]["items"], "the demo retrieves what was learned"
    assert summary["stack_running"] is False
    assert "the demo's stack has stopped" in demo.stderr
    assert "start `alma up` here (it keeps running), then, from any directory:" in demo.stderr

    up = AlmaUp(project)
    up.env.pop("COLUMNS", None)
    endpoints: dict[str, Any] = await up.start()
    try:
        await walk_from_elsewhere(elsewhere, endpoints)
    finally:
        assert await up.stop() == 0, up.stderr()[-3000:]
    gone = await asyncio.to_thread(alma, "runs", "list", "--tenant", "acme", cwd=elsewhere)
    assert gone.returncode == 2
    assert "no `alma up` is running" in gone.stderr
    assert f"looked for .alma/endpoints.json in {elsewhere.resolve()}" in gone.stderr
    assert "start the embedded stack with `alma up` (in any directory)" in gone.stderr


async def walk_from_elsewhere(here: Path, endpoints: dict[str, Any]) -> None:
    listed = await asyncio.to_thread(alma, "runs", "list", "--tenant", "acme", "--json", cwd=here)
    assert listed.returncode == 0, listed.stderr
    run_ids = [r["run_id"] for r in json.loads(listed.stdout)]
    assert run_ids, "the demo's runs, written before `alma up` started, are there"
    table = await asyncio.to_thread(alma, "runs", "list", "--tenant", "acme", cwd=here)
    assert table.returncode == 0, table.stderr
    for run_id in run_ids:
        assert any(run_id in line for line in table.stdout.splitlines()), f"{run_id} cut"
    run = run_ids[0]
    for args in (
        ("runs", "show", run, "--tenant", "acme"),
        ("checkpoints", run, "--tenant", "acme"),
        ("resume", run, "--tenant", "acme"),
        ("dlq", "list"),
        ("offsets", "list"),
        ("topics", "describe"),
        ("db", "status"),
        ("reducers", "list"),
        ("reducers", "show", "research-report", "--tenant", "acme"),
        ("dlq", "list", "--tenant", "acme", "--json"),
        ("--version",),
        *(tuple(words) for words in readme_commands()),
    ):
        result = await asyncio.to_thread(alma, *args, cwd=here)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        assert result.stdout.strip(), args

    # the README's Python snippets, in order, in one namespace, as `python -m asyncio` runs them
    snippets = json.dumps([[b.line, b.text] for b in runnable()])
    ran = await asyncio.to_thread(
        run_as_user, sys.executable, "-c", RUNNER, cwd=here, stdin=snippets
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    assert ran.stdout.count(" ran") == len(runnable())
    rows = await fetch(
        endpoints["postgres_dsn"],
        """SELECT r.workflow_id, r.status, count(c.seq) AS checkpoints,
                  count(c.seq) FILTER (WHERE c.kind = 'merge') AS merges
           FROM runs r LEFT JOIN checkpoints c ON (c.tenant_id, c.run_id) = (r.tenant_id, r.run_id)
           WHERE r.tenant_id = 'acme' AND r.workflow_id IN ('research', 'report', 'billing')
           GROUP BY r.workflow_id, r.status ORDER BY r.workflow_id""",
    )
    got = {(r["workflow_id"], r["status"]): (r["checkpoints"], r["merges"]) for r in rows}
    assert sorted(got) == [
        ("billing", "running"),
        ("report", "running"),  # the time-travel block's fork of the report run
        ("report", "succeeded"),
        ("research", "succeeded"),  # a node failed, the run went on to succeed
    ]
    assert got[("report", "succeeded")][1] == 1  # its merge
    assert got[("report", "running")] == (1, 0)  # the fork: one checkpoint, from seq 1

    # AlmaClient from load() beside a running alma up: the error says what to use instead
    probe = (
        "from alma_core.sdk.client import AlmaClient\n"
        "from alma_core.settings import load\n"
        "AlmaClient(load())"
    )
    refused = await asyncio.to_thread(run_as_user, sys.executable, "-c", probe, cwd=here)
    assert refused.returncode == 1
    assert "an `alma up` is running on" in refused.stderr
    assert "load_running()" in refused.stderr
