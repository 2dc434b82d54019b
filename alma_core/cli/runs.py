"""``alma runs``, ``alma checkpoints`` and ``alma resume``: reading runs.
Exit codes: 0 done, 1 not found or a service failed, 2 bad input."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from alma_core import errors
from alma_core.cli import common
from alma_core.sequencing import SHOWN_STATUSES, short_hash
from alma_core.storage import graphs, runs
from alma_core.storage.cache import RedisCheckpointCache
from alma_core.storage.cache_entries import checkpoint_to_doc
from alma_core.storage.observer import Tally
from alma_core.storage.postgres import connect
from alma_core.storage.reader import CheckpointReader
from alma_core.text import shell_word, visible
from alma_core.types import Checkpoint

runs_app = common.app(
    help="Runs: list them, show one with its events, checkpoints and outcome; its state "
    "at any seq, what changed between two checkpoints, a merge explained, a fork."
)

TENANT_HELP = (
    "Tenant of the run; default ALMA_TENANT (one of them is required unless "
    "ALMA_REQUIRE_TENANT=false)."
)


def register(app: typer.Typer) -> None:
    app.command("checkpoints")(checkpoints)
    app.command("resume")(resume)
    app.add_typer(runs_app, name="runs")


def _jsonable(row: Any) -> dict[str, Any]:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in dict(row).items()}


@runs_app.command("list")
def runs_list(
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    workflow: str = typer.Option(None, "--workflow", help="Only this workflow's runs."),
    status: str = typer.Option(
        None,
        "--status",
        help="running, blocked (running, and waiting on a dead letter of its own), "
        "succeeded, failed, refused (at its tenant's storage quota) or deleted (a LangGraph "
        "thread).",
    ),
    limit: int = typer.Option(50, min=1, max=10_000, help="How many, latest activity first."),
    as_json: bool = common.json_option("the runs"),
) -> None:
    """Runs, latest activity first."""
    s = common.settings()
    if status is not None and status not in (*SHOWN_STATUSES, "deleted"):
        common.fail(
            f"unknown status {status!r}: {', '.join(SHOWN_STATUSES)} or deleted",
            common.USAGE,
        )
    who = common.tenant(s, tenant)

    async def main() -> list[dict[str, Any]]:
        conn = await common.connect(common.dsn(s))
        try:
            rows = await runs.listing(
                conn, tenant_id=who, workflow_id=workflow, status=status, limit=limit
            )
        finally:
            await conn.close()
        return [_jsonable(r) for r in rows]

    docs = common.run(main)
    if as_json:
        print(json.dumps(docs))
        return
    table = Table(title=f"runs ({len(docs)})")
    for col in ("run", "kind", "tenant", "workflow", "status", "checkpoints", "events", "updated"):
        table.add_column(col, overflow="fold")
    for d in docs:
        table.add_row(
            Text(visible(d["run_id"])),
            "LangGraph thread" if d["kind"] == "thread" else "run",
            Text(visible(d["tenant_id"])),
            Text(visible(d["workflow_id"])),
            d["status"],
            str(d["last_seq"]),
            str(d["event_count"]),
            d["updated_at"][:19],
        )
    common.out.print(table)
    if not docs:
        common.out.print(
            "no runs match: check --tenant/--workflow/--status, or publish events "
            "(`alma demo` runs a few)"
        )


async def run_report(conn: Any, run_id: str, tenant: str | None) -> dict[str, Any]:
    """Everything about one run (:func:`alma_core.storage.runs.report`), as JSON."""
    found = await runs.report(conn, run_id, tenant)
    if not found:
        raise _not_found(run_id, tenant)
    return {
        "run": _jsonable(found["run"]) | {"status": found["status"]},
        "forked_from": found["forked_from"],
        "forks": [_jsonable(r) for r in found["forks"]],
        "events": [_jsonable(r) for r in found["events"]],
        "checkpoints": [_jsonable(r) for r in found["checkpoints"]],
        "joins": [_jsonable(r) for r in found["joins"]],
        "outcome": _jsonable(found["outcome"]) if found["outcome"] else None,
        "dead_letters": [_jsonable(r) for r in found["dead_letters"]],
        "blocked_by": [
            _jsonable(r)
            | {"replay": f"alma dlq replay {r['id']} --tenant {shell_word(r['tenant_id'])}"}
            for r in found["blocked_by"]
        ],
    }


@runs_app.command("show")
def runs_show(
    run_id: str = typer.Argument(..., help="The run."),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    as_json: bool = common.json_option("the run"),
) -> None:
    """One run: its events, checkpoints (seq, node, branch, size), joins and outcome."""
    s = common.settings()
    who = common.tenant(s, tenant)

    async def main() -> dict[str, Any]:
        conn = await common.connect(common.dsn(s))
        try:
            return await run_report(conn, run_id, who)
        finally:
            await conn.close()

    doc = common.run(main)
    if as_json:
        print(json.dumps(doc))
        return
    run = doc["run"]
    common.out.print(
        f"[bold]{escape(visible(run_id))}[/bold]  tenant {escape(visible(run['tenant_id']))}  "
        f"workflow {escape(visible(run['workflow_id']))}  status {run['status']}  "
        f"last seq {run['last_seq']}"
    )
    if blocked := doc["blocked_by"]:
        common.out.print(
            f"[bold]blocked[/bold]: the run cannot advance until {len(blocked)} dead "
            f"letter{'s' if len(blocked) > 1 else ''} of its events "
            f"{'are' if len(blocked) > 1 else 'is'} replayed (or its orchestrator sends "
            "what comes next):",
            highlight=False,
        )
        for d in blocked:
            common.out.print(
                f"  #{d['id']} {d['reason']} (event {visible(d['event_id'] or '?')}): "
                f"{visible(d['detail'][:200])}; `{d['replay']}`",
                highlight=False,
                markup=False,
            )
    if lineage := doc["forked_from"]:
        common.out.print(
            f"forked from run {escape(visible(lineage['run_id']))} at seq {lineage['seq']} "
            f"(`alma runs state {escape(shell_word(lineage['run_id']))} --seq {lineage['seq']}`)"
        )
        if lineage.get("patch") is not None:
            ops = len(lineage["patch"])
            common.out.print(f"  its state edited first: a JSON Patch of {ops} operation(s)")
        if lineage.get("note") or lineage.get("asked_by"):
            common.out.print(
                f"  why: {escape(visible(lineage.get('note') or '(no note)'))}"
                f" (asked by {escape(visible(lineage.get('asked_by') or 'someone unnamed'))})"
            )
    if forks := doc["forks"]:
        total = forks[0]["total"]
        common.out.print(
            f"forked {total} time{'s' if total > 1 else ''}"
            + (f" (the newest {len(forks)}):" if total > len(forks) else ":")
        )
        for f in forks:
            why = (
                f"; why: {visible(f['note'] or '(no note)')} (asked by "
                f"{visible(f['asked_by'] or 'someone unnamed')})"
                if f["note"] or f["asked_by"]
                else ""
            )
            common.out.print(
                f"  {visible(f['run_id'])} from seq {f['seq']}"
                f"{', its state edited' if f['patched'] else ''}{why}",
                highlight=False,
                markup=False,
            )
    sections = {
        "events": ("type", "node_id", "branch_id", "effect", "checkpoint_seq", "emitted_at"),
        "checkpoints": (
            "seq",
            "kind",
            "node_id",
            "branch_id",
            "parent_seq",
            "size_bytes",
            "created_at",
        ),
        "joins": ("join_id", "status", "checkpoint_seq", "created_at"),
        "dead_letters": ("id", "reason", "event_id", "detail"),
    }
    for name, cols in sections.items():
        if not doc[name]:
            continue
        table = Table(title=f"{name} ({len(doc[name])})")
        for col in cols:
            table.add_column(col, overflow="fold")
        for row in doc[name]:
            table.add_row(
                *(Text("" if row[c] is None else visible(str(row[c])[:80])) for c in cols)
            )
        common.out.print(table)
    outcome = doc["outcome"]
    if outcome is None:
        common.out.print("no outcome yet (the run has not completed, or the learner is behind)")
    else:
        common.out.print(
            f"outcome: {'success' if outcome['success'] else 'failure'} in "
            f"{outcome['duration_ms']} ms, {outcome['nodes_succeeded']}/"
            f"{outcome['node_count']} nodes, strategy {outcome['strategy']}, "
            f"{outcome['learnings_extracted']} learnings"
        )


def _row(cp: Checkpoint) -> list[str]:
    return [
        str(cp.seq),
        cp.kind,
        cp.node_id or "",
        cp.branch_id or "(main)",
        "" if cp.parent_seq is None else str(cp.parent_seq),
        str(cp.size_bytes),
        short_hash(cp.state_hash),
        cp.created_at.isoformat(timespec="seconds") if cp.created_at else "",
    ]


def _table(title: str, cps: list[Checkpoint]) -> Table:
    table = Table(title=title)
    for col in ("seq", "kind", "node", "branch", "parent", "bytes", "hash", "created"):
        table.add_column(col)
    for cp in cps:
        table.add_row(*_row(cp))
    return table


def _thread_doc(row: Any) -> dict[str, Any]:
    return {**dict(row), "created_at": row["created_at"].isoformat()}


def _print_thread(thread: str, docs: list[dict[str, Any]], as_json: bool) -> None:
    """A LangGraph thread's checkpoints (their values are the graph's, serialized)."""
    if as_json:
        print(json.dumps([{"thread_id": thread, **d} for d in docs]))
        return
    table = Table(title=f"LangGraph checkpoints of thread {thread}")
    for col in ("namespace", "checkpoint", "parent", "step", "source", "written"):
        table.add_column(col)
    for d in docs:
        table.add_row(
            d["checkpoint_ns"] or "(root)",
            d["checkpoint_id"],
            d["parent_checkpoint_id"] or "-",
            str(d["step"]),
            d["source"] or "-",
            d["created_at"][:19],
        )
    common.out.print(table)


def _not_found(run_id: str, tenant: str | None) -> errors.AlmaError:
    scope = f" of tenant {tenant!r}" if tenant else ""
    return errors.AlmaError(
        f"no checkpoints for run {run_id!r}{scope}: check the run id and the tenant "
        "(`alma dlq list` shows events that were rejected)"
    )


def checkpoints(
    run_id: str = typer.Argument(..., help="The run."),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    limit: int = typer.Option(50, min=1, max=10_000, help="How many, newest first."),
    before: int = typer.Option(None, help="Only checkpoints with seq below this."),
    as_json: bool = common.json_option("the checkpoints"),
) -> None:
    """A run's checkpoints, newest first."""
    s = common.settings()
    who = common.tenant(s, tenant)

    async def main() -> None:
        async with connect(common.dsn(s), max_size=2) as pool:
            reader = CheckpointReader(pool, None, tenant_id=who, require_tenant=s.require_tenant)
            history = await reader.history(run_id, limit=limit, before_seq=before)
            thread = (
                [] if history or who is None else await graphs.outline(pool, who, run_id, limit)
            )
        if thread:  # a LangGraph thread: its checkpoints are LangGraph's
            _print_thread(run_id, [_thread_doc(r) for r in thread], as_json)
            return
        if not history:
            raise _not_found(run_id, who)
        if as_json:
            print(json.dumps([checkpoint_to_doc(cp) for cp in history]))
        else:
            common.out.print(_table(f"checkpoints of {run_id}", history))

    common.run(main)


def resume(
    run_id: str = typer.Argument(..., help="The run."),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
    as_json: bool = common.json_option("the resume point"),
) -> None:
    """Where the run resumes: its latest checkpoint and every branch head."""
    s = common.settings()
    who = common.tenant(s, tenant)

    async def main() -> None:
        async with (
            connect(common.dsn(s), max_size=2) as pool,
            RedisCheckpointCache.for_settings(s, common.redis_url(s)) as cache,
        ):
            tally = Tally()
            reader = CheckpointReader(
                pool, cache, tenant_id=who, require_tenant=s.require_tenant, observer=tally
            )
            heads = await reader.branch_heads(run_id)
            status = await reader.status(run_id)
            thread = [] if heads or who is None else await graphs.outline(pool, who, run_id, 50)
        latest = max(heads.values(), key=lambda cp: cp.seq) if heads else None
        root = [_thread_doc(r) for r in thread if r["checkpoint_ns"] == ""][:1]
        if root:  # a LangGraph thread: its graph resumes from its newest checkpoint
            if as_json:
                print(json.dumps({"run_id": run_id, "status": status, "langgraph": root[0]}))
                return
            step = root[0]["step"]
            common.out.print(
                f"{run_id} is a LangGraph thread: its graph resumes from checkpoint "
                f"{root[0]['checkpoint_id']} (step {step}), as graph.ainvoke(None, config) "
                f"with thread_id {run_id!r} does"
            )
            return
        if latest is None and status is None:
            raise errors.AlmaError(
                f"no run {run_id!r}{f' of tenant {who!r}' if who else ''}: check the run id "
                "and the tenant (`alma runs list`). A run ALMA has no event of starts from "
                "the beginning, with an empty state (client.resume says so too)"
            )
        if as_json:
            print(
                json.dumps(
                    {
                        "run_id": run_id,
                        "status": status,
                        "latest": checkpoint_to_doc(latest) if latest else None,
                        "branch_heads": {b or "": checkpoint_to_doc(cp) for b, cp in heads.items()},
                        "state": dict(heads[None].state) if None in heads else {},
                        "cache": dict(tally.counts),
                    }
                )
            )
            return
        if latest is None:
            common.out.print(
                f"run {run_id} ({status}) has no checkpoint yet: it resumes from the start, "
                "with an empty state"
            )
            return
        common.out.print(_table(f"resume point of {run_id} ({status})", [latest]))
        common.out.print(_table("branch heads", sorted(heads.values(), key=lambda c: c.seq)))
        common.out.print_json(json.dumps(latest.state))

    common.run(main)
