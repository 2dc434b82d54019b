"""``alma replay``: re-fold runs' recorded events through today's pure core and compare
every checkpoint with the stored one (:mod:`alma_core.replay`); with ``--apply``, rebuild
the runs that differ as their next projection (:func:`alma_core.storage.replays.migrate`).
Exit codes: 0 every run replayed the same (with ``--apply``: every run is current now),
1 a run differs (is refused), no run was chosen, or a service failed, 2 bad input."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import asyncpg
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from alma_core import replay as replaying
from alma_core.cli import common
from alma_core.reducers import ReducerRegistry, default_registry
from alma_core.settings import Settings
from alma_core.storage import replays
from alma_core.storage.postgres import connect

Visit = Callable[[asyncpg.Connection, str, str], Awaitable[None]]  # one chosen run


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)


def replay(
    run: str = typer.Option(None, "--run", help="One run."),
    workflow: str = typer.Option(None, "--workflow", help="Every run of this workflow."),
    tenant: str = typer.Option(None, "--tenant", help="Only this tenant's runs."),
    since: datetime = typer.Option(None, "--since", help="Runs active since this time (ISO 8601)."),
    everything: bool = typer.Option(False, "--all", help="Every run (of the tenant, if given)."),
    apply: bool = typer.Option(
        False,
        "--apply",
        help="Rebuild the runs that differ with the reducers registered now: their "
        "checkpoints change state in place (same seqs), atomically for readers; the old "
        "states are kept for ALMA_SUPERSEDED_RETENTION_DAYS.",
    ),
    as_json: bool = common.json_option("each run's verdict and the summary"),
) -> None:
    """Replay to verify: fold each chosen run's recorded events again through today's
    reducers, sequencing and merges, and compare every checkpoint's state hash with the
    stored one. Prints each run's first difference (seq, path, both values) and a
    summary; exits 1 when a run differs. With --apply, replay to migrate: each run that
    differs only in its states is rebuilt (one transaction under the run's lock, open
    runs included); a run whose seqs would change is refused and left as it is."""
    if not (run or workflow or since or everything):
        common.fail(
            "choose the runs: --run RUN, --workflow W, --since TIME or --all (with "
            "--tenant T for one tenant's)",
            common.USAGE,
        )
    if everything and (run or workflow or since):
        common.fail(
            "--all chooses every run: give it alone (with --tenant T for one tenant's), or "
            "drop it to replay what --run, --workflow or --since choose",
            common.USAGE,
        )
    s = common.settings()
    who = common.tenant(s, tenant, required=False)
    registry = default_registry()

    async def each(visit: Visit) -> None:
        """Call ``visit`` for each chosen run, with a progress bar."""
        async with connect(common.dsn(s), max_size=2) as pool, pool.acquire() as conn:
            keys = [
                k
                async for k in replays.chosen(
                    conn, tenant_id=who, workflow_id=workflow, run_id=run, since=since
                )
            ]
            if not keys:  # a typo must not pass as "0 different"
                of = f" of tenant {who!r}" if who else ""
                common.fail(
                    f"no run {run!r}{of} to replay: check the id (`alma runs list` shows them)"
                    if run
                    else f"no runs chosen{of}: nothing matches --workflow/--since (`alma "
                    "runs list` shows the runs there are)"
                )
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
            with Progress(*columns, console=common.err, transient=True) as bar:
                task = bar.add_task("migrating" if apply else "replaying", total=len(keys))
                for tenant_id, run_id in keys:
                    await visit(conn, tenant_id, run_id)
                    bar.advance(task)

    if apply:
        _migrate(s, each, registry, as_json)
        return
    verdicts: list[replaying.Verdict] = []

    async def verify(conn: asyncpg.Connection, tenant_id: str, run_id: str) -> None:
        inputs = await replays.load(conn, tenant_id, run_id)
        if inputs is None:
            return
        if inputs.skipped:
            verdicts.append(replaying.Verdict(tenant_id, run_id, 0, 0, skipped=inputs.skipped))
            return
        verdicts.append(
            replaying.replay(
                inputs.run,
                inputs.events,
                inputs.stored,
                config=inputs.config,
                registry=registry,
                max_state_bytes=s.max_state_bytes,
            )
        )

    common.run(lambda: each(verify))
    summary = _summary(verdicts)
    if as_json:
        print(json.dumps({"runs": [v.to_doc() for v in verdicts], "summary": summary}))
    else:
        for v in verdicts:
            if v.skipped:
                common.out.print(f"{v.tenant_id}/{v.run_id}: not replayed: {v.skipped}")
            elif v.difference is not None:
                common.out.print(f"{v.tenant_id}/{v.run_id}: differs {_where(v.difference)}")
        common.out.print(
            f"{summary['runs']} runs, {summary['events']} events, {summary['checkpoints']} "
            f"checkpoints: {summary['same']} the same, {summary['different']} different, "
            f"{summary['skipped']} not replayable"
        )
    if summary["different"]:
        raise typer.Exit(common.FAILED)


def _migrate(
    s: Settings,
    each: Callable[[Visit], Awaitable[None]],
    registry: ReducerRegistry,
    as_json: bool,
) -> None:
    """Migrate each chosen run (:func:`replays.migrate`), then drop the rebuilt runs'
    cache entries (readers never serve them: their hashes are not PostgreSQL's)."""
    done: list[replays.Migrated] = []

    async def migrate(conn: asyncpg.Connection, tenant_id: str, run_id: str) -> None:
        migrated = await replays.migrate(
            conn, tenant_id, run_id, registry=registry, max_state_bytes=s.max_state_bytes
        )
        if migrated is not None:
            done.append(migrated)

    async def main() -> None:
        await each(migrate)
        await common.forget_cached(s, [(m.tenant_id, m.run_id) for m in done if m.changed])

    common.run(main)
    rebuilt = [m for m in done if m.changed]
    refused = [m for m in done if m.refused]
    skipped = [m for m in done if m.skipped]
    summary = {
        "runs": len(done),
        "rebuilt": len(rebuilt),
        "checkpoints": sum(m.changed for m in rebuilt),
        "current": len(done) - len(rebuilt) - len(refused) - len(skipped),
        "refused": len(refused),
        "skipped": len(skipped),
    }
    if as_json:
        print(json.dumps({"runs": [m.to_doc() for m in done], "summary": summary}))
    else:
        for m in done:
            name = f"{m.tenant_id}/{m.run_id}"
            if m.changed:
                common.out.print(
                    f"{name}: rebuilt {m.changed} checkpoints (projection {m.projection})"
                )
            elif m.refused:
                common.out.print(
                    f"{name}: not rebuilt, its seqs would change: {_where(m.refused)}. "
                    "A rebuild keeps every seq; this run stays as it is"
                )
            elif m.skipped:
                common.out.print(f"{name}: not rebuilt: {m.skipped}")
        common.out.print(
            f"{summary['runs']} runs: {summary['rebuilt']} rebuilt ({summary['checkpoints']} "
            f"checkpoints), {summary['current']} already current, {summary['refused']} "
            f"refused, {summary['skipped']} not replayable"
        )
    if refused:
        raise typer.Exit(common.FAILED)


def _where(d: replaying.Difference) -> str:
    """A difference in words: where, what, both sides."""
    path = f" at {d.path}" if d.path else ""
    sides = d.path is not None or d.what == "kind"  # else there are no values to show
    told = [f"stored {_show(d.stored)}, replayed {_show(d.replayed)}"] if sides else []
    return f"at seq {d.seq} ({d.what}{path}): " + "; ".join([*told, *filter(None, [d.detail])])


def _summary(verdicts: list[replaying.Verdict]) -> dict[str, Any]:
    different = sum(1 for v in verdicts if v.difference is not None)
    skipped = sum(1 for v in verdicts if v.skipped)
    return {
        "runs": len(verdicts),
        "events": sum(v.events for v in verdicts),
        "checkpoints": sum(v.checkpoints for v in verdicts),
        "same": len(verdicts) - different - skipped,
        "different": different,
        "skipped": skipped,
    }


def _show(value: Any) -> str:
    return json.dumps(value)[:120]
