"""`alma offsets reset` moves the offsets the workers resume from (stored in PostgreSQL;
Kafka's own reset tool does not touch them): to the log's end, start, an offset or a
time, shown first with --dry-run, refused while the group has members."""

from __future__ import annotations

import asyncio
import json
import time
from functools import partial
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from alma_core.cli.offsets import cluster_id
from alma_core.consumers import worker as worker_module
from alma_core.consumers.runtime import RuntimeConfig
from alma_core.settings import Settings
from tests.integration.harness import Publisher, Worker, completed, count, fetch, wait_for
from tests.integration.test_cli import alma
from tests.integration.test_cli_runs import env_of


async def reset(settings: Settings, group: str, *args: str) -> Any:
    return await asyncio.to_thread(
        alma,
        "offsets",
        "reset",
        "--group",
        group,
        "--topic",
        settings.lifecycle_topic,
        *args,
        env=env_of(settings),
    )


async def stored(settings: Settings, group: str) -> dict[int, int]:
    rows = await fetch(
        settings.postgres_dsn or "",
        "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2",
        group,
        settings.lifecycle_topic,
    )
    return {r["partition"]: r["next_offset"] for r in rows}


async def test_reset_to_latest_skips_what_the_log_holds_and_waits_for_the_members(
    settings: Settings,
) -> None:
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    group = f"{settings.group_prefix}-checkpointer"
    async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
        for i in range(3):
            await pub.send(completed("moved", state={"n": i}))
        await pub.flush()
        async with Worker.start(settings):

            async def three() -> bool:
                return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

            await wait_for(three, what="the first three events")
            before = await stored(settings, group)
            (partition,) = [p for p, offset in before.items() if offset == 3]
            refused = await reset(settings, group, "--to-earliest")
            assert refused.returncode == 1, refused.stderr
            assert "member(s) of group" in refused.stderr
            assert "stop the group's workers" in refused.stderr
            shown = await reset(settings, group, "--to-earliest", "--dry-run", "--json")
            assert shown.returncode == 0, shown.stderr
            plan = json.loads(shown.stdout)
            assert plan["members"] >= 1
            assert plan["applied"] is False
            row = next(r for r in plan["partitions"] if r["partition"] == partition)
            assert (row["stored"], row["after"], row["log_end"]) == (3, 0, 3)
            assert await stored(settings, group) == before, "a dry run changes nothing"
        # while no worker runs: two events that the reset to the end skips
        skipped = [completed("moved", state={"n": i}) for i in (3, 4)]
        for doc in skipped:
            await pub.send(doc)
        await pub.flush()
        # the embedded broker keeps listing a group's first member after it left: --force
        moved = await reset(settings, group, "--to-latest", "--force")
        assert moved.returncode == 0, moved.stderr
        assert "moved the stored offsets" in moved.stderr
        assert (await stored(settings, group))[partition] == 5
        async with Worker.start(settings):
            await pub.send(completed("moved", state={"n": 5}))
            await pub.flush()

            async def four() -> bool:
                return await count(dsn, "SELECT count(*) FROM checkpoints") == 4

            await wait_for(four, what="the event after the reset")
    ids = {r["event_id"] for r in await fetch(dsn, "SELECT event_id FROM run_events")}
    assert not ids & {d["event_id"] for d in skipped}, "the skipped events were applied"
    latest = await fetch(dsn, "SELECT state FROM checkpoints ORDER BY seq DESC LIMIT 1")
    assert latest[0]["state"] == {"n": 5}


@pytest.mark.slow
async def test_reset_to_a_time_an_offset_or_the_start_of_a_group_without_members(
    settings: Settings,
) -> None:
    bootstrap = settings.kafka_bootstrap or ""
    group = f"{settings.group_prefix}-offline"  # never joined: the broker lists no member
    async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
        for i in range(3):
            await pub.send(completed("timed", state={"n": i}))
        await pub.flush()
        await asyncio.sleep(1.5)
        between = time.time()
        await asyncio.sleep(1.5)
        for i in range(3, 6):
            await pub.send(completed("timed", state={"n": i}))
        await pub.flush()
    when = (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(between))
        + f".{int(between % 1 * 1000):03d}Z"
    )

    shown = await reset(settings, group, "--to-datetime", when, "--dry-run", "--json")
    assert shown.returncode == 0, shown.stderr
    plan = json.loads(shown.stdout)
    assert plan["members"] == 0
    rows = {r["partition"]: r for r in plan["partitions"]}
    (partition,) = [p for p, r in rows.items() if r["log_end"] == 6]
    assert rows[partition]["after"] == 3, rows[partition]
    assert all(r["stored"] is None for r in rows.values())
    assert await stored(settings, group) == {}

    timed = await reset(settings, group, "--to-datetime", when)
    assert timed.returncode == 0, timed.stderr
    after = await stored(settings, group)
    assert after[partition] == 3
    assert all(offset == 0 for p, offset in after.items() if p != partition)  # empty logs
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        tp = TopicPartition(settings.lifecycle_topic, partition)
        committed = await admin.list_consumer_group_offsets(group, partitions=[tp])
    finally:
        await admin.close()
    assert committed[tp].offset == 3, "Kafka's committed offset follows (lag exporters)"

    one = ("--partition", str(partition))
    beyond = await reset(settings, group, *one, "--to-offset", "99", "--json")
    assert beyond.returncode == 0, beyond.stderr
    (row,) = json.loads(beyond.stdout)["partitions"]
    assert (row["stored"], row["after"]) == (3, 6)
    assert "outside the log" in row["note"]
    assert (await reset(settings, group, *one, "--to-offset", "1")).returncode == 0
    assert (await stored(settings, group))[partition] == 1
    assert (await reset(settings, group, "--to-earliest")).returncode == 0
    assert set((await stored(settings, group)).values()) == {0}
    cluster = await cluster_id(bootstrap)
    rows_now = await fetch(
        settings.postgres_dsn or "",
        "SELECT DISTINCT cluster_id FROM consumer_offsets WHERE group_id = $1",
        group,
    )
    assert [r["cluster_id"] for r in rows_now] == [cluster], "keyed by the broker's cluster"

    # wrong usage: no such partition, no such topic
    missing = await reset(settings, group, "--partition", "99", "--to-earliest")
    assert missing.returncode == 2
    assert "has no partition 99" in missing.stderr
    other = await asyncio.to_thread(
        alma,
        "offsets",
        "reset",
        "--group",
        group,
        "--topic",
        "no-such-topic",
        "--to-earliest",
        env=env_of(settings),
    )
    assert other.returncode == 2
    assert "no topic 'no-such-topic'" in other.stderr


async def test_kafka_offsets_catch_up_while_the_worker_is_idle(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kafka's committed offsets (what lag exporters and fallbacks read) are committed
    after batches at most every commit interval; a burst's last offsets are committed
    once the worker finds nothing more to poll, not left for the next burst. With the
    interval an hour, only the idle commit can bring them to the log's end."""
    monkeypatch.setattr(
        worker_module, "RuntimeConfig", partial(RuntimeConfig, commit_interval_s=3600)
    )
    dsn = settings.postgres_dsn or ""
    bootstrap = settings.kafka_bootstrap or ""
    group = f"{settings.group_prefix}-checkpointer"
    async with Worker.start(settings), Publisher(bootstrap, settings.lifecycle_topic) as pub:
        for burst in range(2):
            for i in range(20):
                await pub.send(completed(f"idle-{i % 4}", updates={"i": i, "burst": burst}))
            await pub.flush()

            async def applied(n: int = 20 * (burst + 1)) -> bool:
                return await count(dsn, "SELECT count(*) FROM run_events") == n

            await wait_for(applied, what=f"burst {burst} applied")
        stored = {
            r["partition"]: r["next_offset"]
            for r in await fetch(dsn, "SELECT partition, next_offset FROM consumer_offsets")
        }
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            tps = [TopicPartition(settings.lifecycle_topic, p) for p in stored]

            async def caught_up() -> bool:
                found = await admin.list_consumer_group_offsets(group, partitions=tps)
                return all(found[tp].offset == stored[tp.partition] for tp in tps)

            await wait_for(caught_up, limit_s=15, what="Kafka's committed offsets at the end")
        finally:
            await admin.close()
    assert sum(stored.values()) == 40


async def test_list_shows_the_current_cluster_with_log_end_lag_and_members(
    settings: Settings,
) -> None:
    """`alma offsets list`: every partition of each ALMA group on the broker's current
    cluster, with the stored and committed offsets, the log's end, the lag and the
    members; offsets stored for earlier clusters are counted, listed on demand."""
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    group = f"{settings.group_prefix}-checkpointer"
    await fetch(
        dsn,
        """INSERT INTO consumer_offsets (group_id, cluster_id, topic, partition, next_offset)
           VALUES ($1, 'an-earlier-broker', $2, 0, 42)""",
        group,
        settings.lifecycle_topic,
    )
    env = env_of(settings)
    listing = partial(asyncio.to_thread, alma, "offsets", "list", env=env)
    async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
        for i in range(3):
            await pub.send(completed("listed", state={"n": i}))
        await pub.flush()
        async with Worker.start(settings):

            async def three() -> bool:
                return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

            await wait_for(three, what="the first three events")
            running = json.loads((await listing("--json")).stdout)
        for i in (3, 4):  # while no worker runs: two records to apply
            await pub.send(completed("listed", state={"n": i}))
        await pub.flush()
    assert running["cluster"] == await cluster_id(bootstrap)
    mine = [p for p in running["partitions"] if p["group"] == group]
    assert len(mine) == settings.partitions, "every partition, not only those with offsets"
    assert all(p["members"] >= 1 for p in mine)
    (busy,) = [p for p in mine if p["stored"] == 3]
    assert (busy["log_end"], busy["lag"]) == (3, 0)
    assert {p["group"] for p in running["partitions"]} == set(settings.consumer_groups())
    assert running["other_clusters"] == 1
    after = json.loads((await listing("--json")).stdout)
    (now,) = [
        p for p in after["partitions"] if (p["group"], p["partition"]) == (group, busy["partition"])
    ]
    assert (now["stored"], now["log_end"], now["lag"]) == (3, 5, 2)
    human = await listing()
    assert human.returncode == 0, human.stderr
    header = next(line for line in human.stdout.splitlines() if "partition" in line)
    for column in ("group", "topic", "stored", "committed", "log end", "lag", "members"):
        assert column in header, "one header line, never wrapped"
    assert "1 offsets stored for 1 other broker cluster(s)" in human.stdout
    assert "an-earlier-broker" not in human.stdout
    everything = await listing("--all-clusters")
    assert "an-earlier-broker" in everything.stdout
