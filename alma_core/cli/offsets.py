"""``alma offsets``: the consumer groups' offsets, which live in PostgreSQL beside the
effects (so ``kafka-consumer-groups --reset-offsets`` does not move them).

``reset`` is for a broker that lost or replaced its log (the workers pause such a
partition and say so): it deletes the group's stored offsets on the broker's current
cluster, so the group starts again from Kafka's committed offset or the log's start.
Events already applied are still dropped by the inbox (their event ids)."""

from __future__ import annotations

import json
from typing import Any

import typer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from rich.table import Table

from alma_core import errors
from alma_core.cli import common
from alma_core.messaging import kafka
from alma_core.storage import offsets

offsets_app = typer.Typer(help="Consumer offsets stored in PostgreSQL: list, reset.")


def register(app: typer.Typer) -> None:
    app.add_typer(offsets_app, name="offsets")


async def cluster_id(bootstrap: str, client_options: dict[str, Any] | None = None) -> str:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=10_000, **(client_options or {})
    )
    try:
        await admin.start()
        return str((await admin.describe_cluster())["cluster_id"])
    except KafkaError as exc:
        raise errors.AlmaError(
            f"cannot ask Kafka at {bootstrap} for its cluster id: {exc!r}; check "
            "ALMA_KAFKA_BOOTSTRAP"
        ) from exc
    finally:
        await admin.close()


@offsets_app.command("list")
def offsets_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """Every group's stored offsets, by broker cluster."""
    s = common.settings()

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            rows = await offsets.listing(conn)
        finally:
            await conn.close()
        docs = [{**dict(r), "updated_at": r["updated_at"].isoformat()} for r in rows]
        if as_json:
            print(json.dumps(docs))
            return
        table = Table(title=f"stored offsets ({len(docs)})")
        for col in ("group", "cluster", "topic", "partition", "next offset", "updated"):
            table.add_column(col, overflow="fold")
        for d in docs:
            table.add_row(
                d["group_id"],
                d["cluster_id"],
                d["topic"],
                str(d["partition"]),
                str(d["next_offset"]),
                d["updated_at"][:19],
            )
        common.out.print(table)

    common.run(main)


@offsets_app.command("reset")
def offsets_reset(
    group: str = typer.Option(..., help="The group id (see `alma offsets list`)."),
    topic: str = typer.Option(..., help="The topic."),
    partition: int = typer.Option(None, min=0, help="One partition (default: all)."),
) -> None:
    """Forget a group's stored offsets on the broker's current cluster: the group starts
    again from Kafka's committed offset or the log's start. Restart its workers after."""
    s = common.settings()

    async def main() -> None:
        current = await cluster_id(common.bootstrap(s), kafka.client_options(s))
        conn = await common.connect(common.dsn(s))
        try:
            rows = await offsets.forget(conn, group, current, topic, partition)
        finally:
            await conn.close()
        if not rows:
            raise errors.AlmaError(
                f"no stored offsets of group {group!r} for {topic!r} on cluster {current!r}: "
                "see `alma offsets list`"
            )
        for r in rows:
            common.out.print(
                f"forgot {group} {r['topic']}[{r['partition']}] at {r['next_offset']} "
                f"(cluster {current}); restart the group's workers to start from the log"
            )

    common.run(main)
