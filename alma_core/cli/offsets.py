"""``alma offsets``: the consumer groups' offsets, which live in PostgreSQL beside the
effects. The workers resume from those, so Kafka's ``kafka-consumer-groups
--reset-offsets`` moves nothing that matters here: ``alma offsets reset`` is the reset.

* ``--to-earliest``, ``--to-latest``, ``--to-offset N`` or ``--to-datetime T`` set the
  group's stored offsets on the broker's current cluster (one partition, or all of the
  topic's) and Kafka's committed offsets to match (what lag exporters read). Refused
  while the broker lists members of the group: a running member goes on from its own
  position and commits it over the reset. ``--dry-run`` shows each partition's offsets
  before and after and changes nothing.
* With none of them, the stored offsets are forgotten: for a broker that lost or
  replaced its log (the workers pause such a partition and say so), the group starts
  again from Kafka's committed offset or the log's start.

Whichever way the offsets move, events already applied are dropped by the inbox
(their event ids): moving back re-reads, it never applies anything twice."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import typer
from aiokafka.errors import KafkaError
from rich.table import Table

from alma_core import errors
from alma_core.cli import common
from alma_core.messaging import kafka
from alma_core.messaging.broker_view import BrokerView, Member, positions
from alma_core.settings import Settings
from alma_core.storage import offsets

offsets_app = common.app(help="Consumer offsets stored in PostgreSQL: list, reset.")


def register(app: typer.Typer) -> None:
    app.add_typer(offsets_app, name="offsets")


async def cluster_id(bootstrap: str, client_options: dict[str, Any] | None = None) -> str:
    try:
        async with BrokerView(bootstrap, client_options or {}) as broker:
            return await broker.cluster_id()
    except KafkaError as exc:
        raise common.kafka_unavailable(bootstrap, "ask Kafka for its cluster id", exc) from exc


@offsets_app.command("list")
def offsets_list(
    all_clusters: bool = typer.Option(
        False,
        "--all-clusters",
        help="Also the offsets stored for other broker clusters (earlier brokers, such as "
        "the embedded one of an earlier `alma up`).",
    ),
    as_json: bool = common.json_option("the offsets"),
) -> None:
    """Each ALMA group on the broker's current cluster, partition by partition: the
    offset stored beside the effects (where its workers resume), Kafka's committed one,
    the log's end, the lag and the group's members."""
    s = common.settings()

    async def main() -> None:
        async with _services(s) as (broker, conn):
            cluster = await broker.cluster_id()
            rows = await offsets.listing(conn)
            stored = {
                (r["group_id"], r["topic"], r["partition"]): int(r["next_offset"])
                for r in rows
                if r["cluster_id"] == cluster
            }
            groups = s.consumer_groups() | {g: t for g, t, _ in stored}
            found = await positions(broker, stored, groups, missing=common.note)
        others = [
            {**dict(r), "updated_at": r["updated_at"].isoformat()}
            for r in rows
            if r["cluster_id"] != cluster
        ]
        if as_json:
            doc: dict[str, Any] = {"cluster": cluster, "partitions": [asdict(p) for p in found]}
            doc["other_clusters"] = others if all_clusters else len(others)
            print(json.dumps(doc))
            return
        table = Table(title=f"offsets on the broker's cluster {cluster}")
        for col in (
            "group",
            "topic",
            "partition",
            "stored",
            "committed",
            "log end",
            "lag",
            "members",
        ):
            table.add_column(col, justify="left" if col in ("group", "topic") else "right")
        for p in found:
            table.add_row(
                p.group,
                p.topic,
                str(p.partition),
                _or_dash(p.stored),
                _or_dash(p.committed),
                str(p.log_end),
                str(p.lag),
                str(p.members),
            )
        common.out.print(table)
        if others and not all_clusters:
            clusters = len({r["cluster_id"] for r in others})
            common.out.print(
                f"{len(others)} offsets stored for {clusters} other broker cluster(s) (earlier "
                "brokers: an embedded broker starts a new cluster each time) are not shown: "
                "--all-clusters lists them"
            )
        elif others:
            earlier = Table(title=f"offsets stored for other broker clusters ({len(others)})")
            for col in ("group", "cluster", "topic", "partition", "next offset", "updated"):
                earlier.add_column(col)
            for d in others:
                earlier.add_row(
                    d["group_id"],
                    d["cluster_id"],
                    d["topic"],
                    str(d["partition"]),
                    str(d["next_offset"]),
                    d["updated_at"][:19],
                )
            common.out.print(earlier)

    common.run(main)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


@dataclass(frozen=True)
class Target:
    """Where a reset moves the offsets: ``earliest``, ``latest``, ``offset``, ``time``
    (``value`` the offset or the time in ms) or ``forget``."""

    kind: str
    value: int | None = None

    def describe(self) -> str:
        if self.kind == "offset":
            return f"offset {self.value}"
        if self.kind == "time":
            when = datetime.fromtimestamp((self.value or 0) / 1000, UTC)
            return f"the first record at or after {when.isoformat()}"
        return {
            "earliest": "the start of the log",
            "latest": "the end of the log",
            "forget": "forget the stored offsets",
        }[self.kind]


@dataclass(frozen=True)
class Move:
    """One partition's offsets before and after a reset (``after`` None: forgotten)."""

    partition: int
    log_start: int
    log_end: int
    stored: int | None
    committed: int | None
    after: int | None
    note: str = ""


def parse_time(text: str) -> int:
    """``text`` (ISO 8601; UTC unless it names a zone) in ms since the epoch."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        common.fail(
            f"--to-datetime {text!r} is not an ISO 8601 time: e.g. 2026-05-01T12:00:00Z",
            common.USAGE,
        )
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def target_of(earliest: bool, latest: bool, offset: int | None, when: str | None) -> Target:
    given = {
        "--to-earliest": earliest,
        "--to-latest": latest,
        "--to-offset": offset is not None,
        "--to-datetime": when is not None,
    }
    chosen = [name for name, on in given.items() if on]
    if len(chosen) > 1:
        common.fail(f"choose one of {' and '.join(chosen)}", common.USAGE)
    if earliest:
        return Target("earliest")
    if latest:
        return Target("latest")
    if offset is not None:
        return Target("offset", offset)
    if when is not None:
        return Target("time", parse_time(when))
    return Target("forget")


async def plan(
    broker: BrokerView,
    conn: asyncpg.Connection,
    *,
    group: str,
    cluster: str,
    topic: str,
    partitions: list[int],
    target: Target,
) -> list[Move]:
    """Each partition's offsets now and where ``target`` puts them."""
    logs = await broker.logs(topic, partitions)
    committed = await broker.committed(group, topic, partitions)
    stored = await offsets.stored_offsets(conn, group, cluster, [(topic, p) for p in partitions])
    at_time = await broker.at_time(topic, logs, target.value or 0) if target.kind == "time" else {}
    moves = []
    for p in partitions:
        log, note = logs[p], ""
        after: int | None = None
        if target.kind == "earliest":
            after = log.start
        elif target.kind == "latest":
            after = log.end
        elif target.kind == "offset":
            after = log.clamp(target.value or 0)
            if after != target.value:
                note = f"{target.value} is outside the log: kept within it"
        elif target.kind == "time":
            after = at_time[p]
            if after == log.end:
                note = "no record at or after that time: the end of the log"
        moves.append(Move(p, log.start, log.end, stored.get((topic, p)), committed[p], after, note))
    return moves


async def store(
    conn: asyncpg.Connection, group: str, cluster: str, topic: str, moves: list[Move]
) -> None:
    """Set the stored offsets to ``moves``' targets, in one statement."""
    chosen = {m.partition: m.after for m in moves if m.after is not None}
    await offsets.set_offsets(conn, group, cluster, topic, chosen)


def _show(title: str, moves: list[Move]) -> None:
    table = Table(title=title)
    for col in ("partition", "log", "stored (before)", "Kafka committed", "after", "note"):
        table.add_column(col)
    for m in moves:
        table.add_row(
            str(m.partition),
            f"{m.log_start}-{m.log_end}",
            "-" if m.stored is None else str(m.stored),
            "-" if m.committed is None else str(m.committed),
            "forgotten" if m.after is None else str(m.after),
            m.note,
        )
    common.out.print(table)


def _refusal(group: str, members: list[Member]) -> errors.AlmaError:
    ids = ", ".join(m.member_id for m in members[:3]) + (", ..." if len(members) > 3 else "")
    return errors.AlmaError(
        f"the broker lists {len(members)} member(s) of group {group!r} ({ids}): a running "
        "member goes on from its own position and commits it over the reset. What to do: "
        "stop the group's workers (`alma worker`, `alma up`, or its Deployment scaled to 0), "
        "check with --dry-run, then run again; --force resets anyway, only when you know "
        "the members are gone (the embedded broker keeps listing a group's first member "
        "after it left)"
    )


@contextlib.asynccontextmanager
async def _services(s: Settings) -> AsyncIterator[tuple[BrokerView, asyncpg.Connection]]:
    conn = await common.connect(common.dsn(s))
    try:
        bootstrap = common.bootstrap(s)
        async with BrokerView(bootstrap, kafka.client_options(s)) as broker:
            yield broker, conn
    except KafkaError as exc:
        raise common.kafka_unavailable(bootstrap, "read the group's offsets", exc) from exc
    finally:
        await conn.close()


@offsets_app.command("reset")
def offsets_reset(
    group: str = typer.Option(
        ..., help="The group id: <ALMA_GROUP_PREFIX>-checkpointer, -joiner or -learner."
    ),
    topic: str = typer.Option(..., help="The topic the group reads."),
    partition: int = typer.Option(None, min=0, help="One partition (default: all)."),
    to_earliest: bool = typer.Option(
        False, "--to-earliest", help="The start of the log: what it holds is read again."
    ),
    to_latest: bool = typer.Option(
        False, "--to-latest", help="The end of the log: what it holds now is skipped."
    ),
    to_offset: int = typer.Option(
        None, "--to-offset", min=0, help="This offset (kept within the log)."
    ),
    to_datetime: str = typer.Option(
        None,
        "--to-datetime",
        help="The first record at or after this time (ISO 8601, UTC unless it names a zone).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show each partition's offsets before and after; change nothing."
    ),
    force: bool = typer.Option(
        False, "--force", help="Reset even though the broker lists members of the group."
    ),
    as_json: bool = common.json_option("the partitions before and after"),
) -> None:
    """Move a group's stored offsets (the ones its workers resume from) to the log's
    start or end, an offset or a time; without --to-*, forget them. Stop the group's
    workers first; start them after."""
    s = common.settings()
    target = target_of(to_earliest, to_latest, to_offset, to_datetime)

    async def main() -> None:
        async with _services(s) as (broker, conn):
            cluster = await broker.cluster_id()
            known = await broker.partitions(topic)
            if partition is not None and partition not in known:
                raise errors.ConfigError(
                    f"{topic!r} has no partition {partition}: it has 0 to {max(known)}"
                )
            chosen = known if partition is None else [partition]
            moves = await plan(
                broker,
                conn,
                group=group,
                cluster=cluster,
                topic=topic,
                partitions=chosen,
                target=target,
            )
            members = await broker.members(group)
            applied = not dry_run and (target.kind == "forget" or not members or force)
            if as_json:
                doc = {
                    "group": group,
                    "topic": topic,
                    "cluster": cluster,
                    "target": target.describe(),
                    "members": len(members),
                    "applied": applied,
                    "partitions": [asdict(m) for m in moves],
                }
                print(json.dumps(doc))
            else:
                _show(f"{group} on {topic} (cluster {cluster}): {target.describe()}", moves)
            if dry_run:
                if members:
                    common.note(f"the broker lists {len(members)} member(s) of {group!r} now")
                common.err.print("dry run: nothing changed")
                return
            if target.kind == "forget":
                await _forget(conn, group, cluster, topic, partition, members)
                return
            if not applied:
                raise _refusal(group, members)
            async with conn.transaction():
                await store(conn, group, cluster, topic, moves)
            common.err.print(
                f"moved the stored offsets of {group} on {topic} ({len(moves)} partitions) to "
                f"{target.describe()}; start the group's workers: they resume there"
            )
            await _commit_to_kafka(broker, group, topic, moves)

    common.run(main)


async def _forget(
    conn: asyncpg.Connection,
    group: str,
    cluster: str,
    topic: str,
    partition: int | None,
    members: list[Member],
) -> None:
    rows = await offsets.forget(conn, group, cluster, topic, partition)
    if not rows:
        raise errors.AlmaError(
            f"no stored offsets of group {group!r} for {topic!r} on cluster {cluster!r}: "
            "see `alma offsets list`"
        )
    for r in rows:
        common.out.print(
            f"forgot {group} {r['topic']}[{r['partition']}] at {r['next_offset']} "
            f"(cluster {cluster}); restart the group's workers to start from the log"
        )
    if members:
        common.note(
            f"the broker lists {len(members)} member(s) of {group!r}: they keep their "
            "positions until they restart"
        )


async def _commit_to_kafka(broker: BrokerView, group: str, topic: str, moves: list[Move]) -> None:
    """Kafka's committed offsets follow (lag exporters read them); the stored ones are
    what the workers resume from, so a broker that refuses only earns a note."""
    try:
        await broker.commit(
            group, topic, {m.partition: m.after for m in moves if m.after is not None}
        )
    except KafkaError as exc:
        common.note(
            f"Kafka's committed offsets of {group} were not moved ({exc!r}): the workers "
            "resume from the stored ones and commit theirs after their first batch"
        )
    else:
        common.err.print("Kafka's committed offsets of the group moved to the same offsets")
