"""``alma replay``: re-fold runs' recorded events through today's pure core and compare
every checkpoint with the stored one (:mod:`alma_core.replay`). Exit codes: 0 every
run replayed the same, 1 a run differs or a service failed, 2 bad input."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from alma_core import replay as replaying
from alma_core.cli import common
from alma_core.reducers import default_registry
from alma_core.storage import replays
from alma_core.storage.postgres import connect


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)


def replay(
    run: str = typer.Option(None, "--run", help="One run."),
    workflow: str = typer.Option(None, "--workflow", help="Every run of this workflow."),
    tenant: str = typer.Option(None, "--tenant", help="Only this tenant's runs."),
    since: datetime = typer.Option(None, "--since", help="Runs active since this time (ISO 8601)."),
    everything: bool = typer.Option(False, "--all", help="Every run (of the tenant, if given)."),
    as_json: bool = common.json_option("each run's verdict and the summary"),
) -> None:
    """Replay to verify: fold each chosen run's recorded events again through today's
    reducers, sequencing and merges, and compare every checkpoint's state hash with the
    stored one. Prints each run's first difference (seq, path, both values) and a
    summary; exits 1 when a run differs."""
    if not (run or workflow or since or everything):
        common.fail(
            "choose the runs: --run RUN, --workflow W, --since TIME or --all (with "
            "--tenant T for one tenant's)",
            common.USAGE,
        )
    s = common.settings()
    who = common.tenant(s, tenant, required=False)
    registry = default_registry()

    async def main() -> list[replaying.Verdict]:
        verdicts: list[replaying.Verdict] = []
        async with connect(common.dsn(s), max_size=2) as pool, pool.acquire() as conn:
            keys = [
                k
                async for k in replays.chosen(
                    conn, tenant_id=who, workflow_id=workflow, run_id=run, since=since
                )
            ]
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
            with Progress(*columns, console=common.err, transient=True) as bar:
                task = bar.add_task("replaying", total=len(keys))
                for tenant_id, run_id in keys:
                    inputs = await replays.load(conn, tenant_id, run_id)
                    bar.advance(task)
                    if inputs is None:
                        continue
                    if inputs.skipped:
                        verdicts.append(
                            replaying.Verdict(tenant_id, run_id, 0, 0, skipped=inputs.skipped)
                        )
                        continue
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
        return verdicts

    verdicts = common.run(main)
    summary = _summary(verdicts)
    if as_json:
        print(json.dumps({"runs": [v.to_doc() for v in verdicts], "summary": summary}))
    else:
        for v in verdicts:
            if v.skipped:
                common.out.print(f"{v.tenant_id}/{v.run_id}: not replayed: {v.skipped}")
            elif v.difference is not None:
                d = v.difference
                where = f" at {d.path}" if d.path else ""
                common.out.print(
                    f"{v.tenant_id}/{v.run_id}: differs at seq {d.seq} ({d.what}{where}): "
                    f"stored {_show(d.stored)}, replayed {_show(d.replayed)}"
                    + (f"; {d.detail}" if d.detail else "")
                )
        common.out.print(
            f"{summary['runs']} runs, {summary['events']} events, {summary['checkpoints']} "
            f"checkpoints: {summary['same']} the same, {summary['different']} different, "
            f"{summary['skipped']} not replayable"
        )
    if summary["different"]:
        raise typer.Exit(common.FAILED)


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
