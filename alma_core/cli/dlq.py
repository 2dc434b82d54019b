"""``alma dlq``: dead letters, listed and replayed (as they were, or corrected)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from rich.table import Table

from alma_core.cli import common
from alma_core.messaging import acls, kafka
from alma_core.sdk import dead_letters as letters
from alma_core.storage import dead_letters

dlq_app = common.app(help="Dead letters: list them, replay them.")


def register(app: typer.Typer) -> None:
    app.add_typer(dlq_app, name="dlq")


@dlq_app.command("list")
def dlq_list(
    limit: int = typer.Option(50, min=1, max=10_000),
    reason: str = typer.Option(None, help="Only this reason (e.g. schema_violation)."),
    tenant: str = typer.Option(
        None, "--tenant", help="Only this tenant's dead letters; default ALMA_TENANT (unset: all)."
    ),
    as_json: bool = common.json_option("the dead letters"),
) -> None:
    """Dead letters, newest first."""
    s = common.settings()
    who = common.tenant(s, tenant, required=False)

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            rows = await dead_letters.listing(conn, reason=reason, tenant_id=who, limit=limit)
        finally:
            await conn.close()
        docs: list[dict[str, Any]] = [
            {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in r.items()}
            for r in rows
        ]
        if as_json:
            print(json.dumps(docs))
            return
        table = Table(title=f"dead letters ({len(docs)})")
        for col in ("id", "reason", "run", "event", "source", "when", "replayed", "detail"):
            table.add_column(col, overflow="fold")
        for d in docs:
            table.add_row(
                str(d["id"]),
                d["reason"],
                d["run_id"] or "",
                d["event_id"] or "",
                f"{d['source_topic']}[{d['source_partition']}]@{d['source_offset']}",
                d["created_at"][:19],
                (d["replayed_at"] or "")[:19],
                d["detail"][:120],
            )
        common.out.print(table)

    common.run(main)


@dlq_app.command("replay")
def dlq_replay(
    letter_id: int = typer.Argument(
        None, help="The dead letter's id (from `alma dlq list`); or --run."
    ),
    run: str = typer.Option(
        None,
        "--run",
        help="Every letter of this run not replayed yet, oldest first (a run refused at its "
        "tenant's storage quota is reopened by the first); with --tenant or ALMA_TENANT.",
    ),
    tenant: str = typer.Option(None, "--tenant", help="The run's tenant (with --run)."),
    value_file: Path = typer.Option(
        None, "--value-file", help="A corrected JSON event to send instead of the original."
    ),
    force: bool = typer.Option(False, help="Send even if the value would be rejected again."),
) -> None:
    """Send a dead letter (or a corrected version), or every letter of a run, back to the
    lifecycle topic."""
    s = common.settings()
    if (letter_id is None) == (run is None):
        common.fail("give a dead letter's id or --run RUN (one of them)", common.USAGE)
    if run is not None and value_file is not None:
        common.fail("--value-file corrects one letter: give its id, not --run", common.USAGE)
    owner = common.tenant(s, tenant, required=True) if run is not None else None
    try:
        corrected = value_file.read_bytes() if value_file else None
    except OSError as exc:
        common.fail(f"cannot read {value_file}: {exc.strerror}", common.USAGE)

    async def main() -> None:
        sent_to: list[str] = []
        conn = await common.connect(common.dsn(s))
        producer = AIOKafkaProducer(
            bootstrap_servers=common.bootstrap(s), **kafka.producer_options(s)
        )

        async def send(topic: str, value: bytes, key: bytes | None) -> None:
            try:
                if not sent_to:
                    await producer.start()
                await producer.send_and_wait(topic, value, key=key)
            except acls.REFUSALS as exc:  # the authorizer said no: no outage to wait out
                who = acls.principal(s)
                raise acls.denied(who, acls.Acl("WRITE", "topic", topic), exc) from exc
            except KafkaError as exc:
                raise common.kafka_unavailable(
                    common.bootstrap(s), f"publish to {topic}", exc
                ) from exc
            sent_to.append(topic)

        try:
            if run is not None and owner is not None:
                sent = await letters.replay_run(
                    conn, send, owner, run, letters.ReplayChecks.of(s), force=force
                )
                done = f"replayed dead letters {', '.join(map(str, sent))} of run {run!r}"
            else:
                await letters.replay(
                    conn,
                    send,
                    letter_id,
                    letters.ReplayChecks.of(s),
                    corrected=corrected,
                    force=force,
                )
                done = f"replayed dead letter {letter_id}"
        finally:
            await producer.stop()
            await conn.close()
        common.out.print(f"{done} to {sent_to[0]}")

    common.run(main)
