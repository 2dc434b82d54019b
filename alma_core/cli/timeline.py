"""``alma runs state``, ``alma runs diff``, ``alma runs merge`` and ``alma runs fork``: a
run's past (:class:`~alma_core.sdk.timeline.Timeline`). Exit codes: 0 done, 1 not found
or a service failed, 2 bad input."""

from __future__ import annotations

import getpass
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.table import Table

from alma_core import history
from alma_core.cli import common
from alma_core.cli.runs import TENANT_HELP, runs_app
from alma_core.sdk.client import AlmaClient
from alma_core.sdk.timeline import Timeline
from alma_core.settings import Settings
from alma_core.storage.cache_entries import checkpoint_to_doc
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from alma_core.types import WorkflowContext

T = TypeVar("T")


def register(app: typer.Typer) -> None:
    """The commands are added to ``alma runs`` (:data:`runs_app`) when imported."""


def _read(s: Settings, make: Callable[[Timeline], Awaitable[T]]) -> T:
    """Run ``make`` with a Timeline over PostgreSQL alone (reads need no broker)."""

    async def main() -> T:
        async with connect(common.dsn(s), max_size=2) as pool:

            async def reader(tenant: str) -> CheckpointReader:
                return CheckpointReader(pool, None, tenant_id=tenant)

            return await make(Timeline(reader=reader))

    return common.run(main)


def _show(value: Any) -> str:
    """A value in a table: ``(absent)`` where the side has no such field, ``null``
    where it holds null."""
    return "(absent)" if value is history.ABSENT else json.dumps(value)[:120]


@runs_app.command("state")
def runs_state(
    run_id: str = typer.Argument(..., help="The run."),
    seq: int = typer.Option(..., "--seq", min=1, help="The moment: a checkpoint's seq."),
    branch: str = typer.Option(None, "--branch", help="A branch's state (default: main line)."),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    as_json: bool = common.json_option("the checkpoint"),
) -> None:
    """The run's state as it was at a seq: the main line's (or a branch's) newest
    checkpoint at or below it."""
    s = common.settings()
    who = common.tenant(s, tenant, required=True)
    ctx = WorkflowContext(tenant_id=who, run_id=run_id)
    found = _read(s, lambda t: t.state_at(ctx, seq, branch))
    if found is None:
        where = f"branch {branch!r}" if branch else "the main line"
        common.fail(
            f"run {run_id!r} of tenant {who!r} has no checkpoint on {where} at or before "
            f"seq {seq}: `alma checkpoints {run_id}` lists those it has"
        )
    if as_json:
        print(json.dumps(checkpoint_to_doc(found)))
        return
    common.out.print(
        f"{run_id} at seq {seq}: checkpoint {found.seq} ({found.kind}, node "
        f"{found.node_id or '-'}{f', branch {found.branch_id}' if found.branch_id else ''})"
    )
    common.out.print_json(json.dumps(found.state))


@runs_app.command("diff")
def runs_diff(
    run_id: str = typer.Argument(..., help="The run."),
    a: int = typer.Argument(..., min=1, help="The earlier checkpoint's seq."),
    b: int = typer.Argument(..., min=1, help="The later checkpoint's seq."),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    as_json: bool = common.json_option("the changes"),
) -> None:
    """What changed from checkpoint A to checkpoint B, by path (JSON Pointer): keys
    added, removed and changed; lists by index."""
    s = common.settings()
    who = common.tenant(s, tenant, required=True)
    ctx = WorkflowContext(tenant_id=who, run_id=run_id)
    changes = _read(s, lambda t: t.diff(ctx, a, b))
    if as_json:
        print(json.dumps([c.to_doc() for c in changes]))
        return
    if not changes:
        common.out.print(f"checkpoints {a} and {b} of {run_id} hold the same state")
        return
    table = Table(title=f"{run_id}: {a} → {b} ({len(changes)} changes)")
    for col in ("path", "change", "before", "after"):
        table.add_column(col, overflow="fold")
    for c in changes:
        table.add_row(
            c.path or "(the whole state)",
            c.kind,
            _show(c.before),
            _show(c.after),
        )
    common.out.print(table)


@runs_app.command("merge")
def runs_merge(
    run_id: str = typer.Argument(..., help="The run."),
    seq: int = typer.Argument(..., min=1, help="The merged checkpoint's seq."),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    as_json: bool = common.json_option("the merge"),
) -> None:
    """A merged checkpoint beside its inputs: for each field, the reducer, the main
    line's value before, each branch's value and the result."""
    s = common.settings()
    who = common.tenant(s, tenant, required=True)
    ctx = WorkflowContext(tenant_id=who, run_id=run_id)
    view = _read(s, lambda t: t.merge(ctx, seq))
    if as_json:
        print(json.dumps(view.to_doc()))
        return
    before = f"onto checkpoint {view.before.seq}" if view.before else "from the given states"
    table = Table(title=f"{run_id}: merge {seq} {before}")
    for col in ("field", "reducer", "before", *view.labels, "result"):
        table.add_column(col, overflow="fold")
    for f in view.fields:
        table.add_row(f.field, f.reducer, _show(f.before), *map(_show, f.inputs), _show(f.result))
    common.out.print(table)


@runs_app.command("fork")
def runs_fork(
    run_id: str = typer.Argument(..., help="The run to fork."),
    seq: int = typer.Option(..., "--seq", min=1, help="The moment to fork from."),
    new_run_id: str = typer.Option(..., "--as", help="The new run's id."),
    branch: str = typer.Option(None, "--branch", help="Fork a branch's state instead."),
    patch_file: Path = typer.Option(
        None,
        "--patch",
        help="A JSON Patch (RFC 6902) file, or - for stdin: the state is edited first "
        "(checked before anything is written).",
    ),
    note: str = typer.Option(None, "--note", help="Why: kept in the new run's lineage."),
    asked_by: str = typer.Option(
        None, "--by", help="Who asks (default: this user's login name), kept with the note."
    ),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    as_json: bool = common.json_option("the new run's first checkpoint"),
) -> None:
    """Start a new run (same tenant and workflow) from the run's state at a seq, edited
    by a JSON Patch if given; its first checkpoint records where it came from, the
    patch, why and who asked. Asked again, it is the same fork."""
    s = common.resolved(common.settings())
    who = common.tenant(s, tenant, required=True)
    ctx = WorkflowContext(tenant_id=who, run_id=run_id)
    patch = None if patch_file is None else _patch(patch_file)
    by = asked_by or (getpass.getuser() if patch is not None or note else None)

    async def main() -> dict[str, Any]:
        async with AlmaClient(s) as client:
            applied = await Timeline(client).fork(
                ctx, seq, new_run_id, branch_id=branch, patch=patch, note=note, asked_by=by
            )
        return {"run_id": new_run_id, "event_id": applied.event_id, "seq": applied.seq}

    doc = common.run(main)
    if as_json:
        print(json.dumps(doc))
        return
    common.out.print(
        f"forked {run_id} at seq {seq} as {new_run_id} (checkpoint {doc['seq']}); "
        f"next: publish its events with run_id {new_run_id!r}, or "
        f"`alma runs show {new_run_id}`"
    )


def _patch(path: Path) -> Any:
    """The JSON in ``path`` (``-``: stdin); a clear usage error when it is not JSON."""
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
        return json.loads(text)
    except (OSError, ValueError) as exc:
        common.fail(f"--patch {path}: not a JSON file ({exc})", common.USAGE)
