"""One checker for every fault scenario, independent of the workers' code: it reads the
orchestrator's record of what the broker acknowledged, the topic itself (with
confluent-kafka, a client the workers do not use), PostgreSQL's tables with plain SQL,
and Redis through the cache's own reader.

What it holds ALMA to (docs/guarantees.md, guarantee 10):

* every acknowledged event is on the topic (the cluster lost no acknowledged record);
* every acknowledged event has exactly one checkpoint (``lost``, ``doubled``), each
  run's seqs are 1..n in the order its events were acknowledged, and each run's state
  folded every step once (an ``append`` history equal to its steps);
* every join the orchestrator saw answered has exactly one merged checkpoint, at the
  seq its reply named, merging that round's two branches over everything before
  (``history`` 0..2k+1); every join on record was answered on the reply topic, and
  replies beyond one per request are counted (``replies_repeated``: the outbox
  publishes at least once, so a failover can send a reply again);
* the cache holds each run's latest checkpoint or nothing (never another state);
* no dead letters (nothing here is poison).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from confluent_kafka import Consumer, TopicPartition

from alma_core.settings import Settings
from alma_core.storage.cache import RedisCheckpointCache
from tests.cluster.orchestrator import TENANT


@dataclass
class Verdict:
    acknowledged: int = 0
    on_topic: int = 0
    applied: int = 0
    lost: int = 0
    doubled: int = 0
    dead_letters: int = 0
    cache_entries: int = 0
    joins: int = 0  # merges the orchestrator saw answered
    replies_repeated: int = 0  # reply records beyond one per request for the join
    longest_wait_s: float = 0.0  # from an event's acknowledgement to its checkpoint
    longest_wait_after_heal_s: float = 0.0  # the same, of events acknowledged once healed
    longest_publish_s: float = 0.0  # from an event's first send to its acknowledgement
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def acknowledged(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def topic_records(bootstrap: str, topic: str, limit_s: float = 60) -> list[dict[str, Any]]:
    """Every record's JSON value on ``topic``, read to the end of each partition."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "alma-cluster-checker",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=20).topics[topic].partitions
        ends = {}
        for p in partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=20)
            ends[p] = high
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        seen: list[dict[str, Any]] = []
        positions = dict.fromkeys(partitions, 0)
        deadline = time.monotonic() + limit_s
        while any(positions[p] < ends[p] for p in partitions) and time.monotonic() < deadline:
            for msg in consumer.consume(500, timeout=1.0):
                if msg.error():
                    continue
                positions[msg.partition()] = msg.offset() + 1
                seen.append(json.loads(msg.value()))
        short = {p: (positions[p], ends[p]) for p in partitions if positions[p] < ends[p]}
        if short:
            raise AssertionError(f"{topic}: not read to the end within {limit_s} s: {short}")
        return seen
    finally:
        consumer.close()


async def check(settings: Settings, acked_path: Path, healed_at: float | None = None) -> Verdict:
    """The verdict on a scenario's events; ``healed_at`` (epoch seconds): when its fault
    healed, for the longest wait of an event acknowledged after it."""
    assert settings.kafka_bootstrap
    assert settings.postgres_dsn
    verdict = Verdict()
    lines = acknowledged(acked_path)
    acked = [a for a in lines if "event_id" in a]
    joined = [a for a in lines if "join_id" in a]
    verdict.acknowledged = len(acked)
    records = await asyncio.to_thread(
        topic_records, settings.kafka_bootstrap, settings.lifecycle_topic
    )
    on_topic = Counter(r["event_id"] for r in records)
    missing_on_topic = [a["event_id"] for a in acked if a["event_id"] not in on_topic]
    verdict.on_topic = len(acked) - len(missing_on_topic)
    if missing_on_topic:
        verdict.problems.append(
            f"{len(missing_on_topic)} acknowledged events are not on the topic, e.g. "
            f"{missing_on_topic[:3]}"
        )
    conn = await asyncpg.connect(settings.postgres_dsn)
    try:
        rows = await conn.fetch(
            "SELECT run_id, seq, kind, branch_id, event_id, state_hash, state::text AS state, "
            "extract(epoch FROM created_at)::float8 AS created "
            "FROM checkpoints WHERE tenant_id = $1 ORDER BY run_id, seq",
            TENANT,
        )
        join_rows = await conn.fetch(
            "SELECT run_id, join_id, status, checkpoint_seq FROM joins WHERE tenant_id = $1",
            TENANT,
        )
        verdict.dead_letters = int(await conn.fetchval("SELECT count(*) FROM dead_letters"))
    finally:
        await conn.close()
    applied = Counter(r["event_id"] for r in rows)
    verdict.applied = sum(1 for a in acked if applied[a["event_id"]] >= 1)
    verdict.lost = len(acked) - verdict.applied
    verdict.doubled = sum(1 for n in applied.values() if n > 1)
    created = {r["event_id"]: r["created"] for r in rows}
    waits = [created[a["event_id"]] - a["at"] for a in acked if a["event_id"] in created]
    verdict.longest_wait_s = max(waits, default=0.0)
    if healed_at is not None:
        verdict.longest_wait_after_heal_s = max(
            (
                created[a["event_id"]] - a["at"]
                for a in acked
                if a["event_id"] in created and a["at"] >= healed_at
            ),
            default=0.0,
        )
    verdict.longest_publish_s = max((a.get("publish_s", 0.0) for a in acked), default=0.0)
    if verdict.lost:
        lost = [a["event_id"] for a in acked if not applied[a["event_id"]]]
        verdict.problems.append(f"{verdict.lost} acknowledged events not applied, e.g. {lost[:3]}")
    if verdict.doubled:
        verdict.problems.append(f"{verdict.doubled} events applied more than once")
    if verdict.dead_letters:
        verdict.problems.append(f"{verdict.dead_letters} dead letters (no event here is poison)")
    # each run's checkpoints in seq order: 1..n, in the order its events were
    # acknowledged (a merge's event is the join request, checked below)
    runs: dict[str, list[asyncpg.Record]] = {}
    for r in rows:
        runs.setdefault(r["run_id"], []).append(r)
    expected: dict[str, list[str]] = {}
    for a in acked:
        expected.setdefault(a["run"], []).append(a["event_id"])
    for run, event_ids in expected.items():
        got = [r["event_id"] for r in runs.get(run, []) if r["kind"] != "merge"]
        if got[: len(event_ids)] != event_ids:
            verdict.problems.append(f"{run}: checkpoints {got[:5]}... not its events in order")
    for run, its in runs.items():
        if [r["seq"] for r in its] != list(range(1, len(its) + 1)):
            verdict.problems.append(f"{run}: seqs are not 1..n")
        # the main line, as of its last checkpoint there (a node, or a merge of the
        # branches before it), folded every node before it once
        main = [r for r in its if r["branch_id"] is None]
        if not main:
            continue
        history = json.loads(main[-1]["state"]).get("history") or []
        nodes = sum(1 for r in its if r["kind"] == "node" and r["seq"] <= main[-1]["seq"])
        if history != list(range(nodes)):
            verdict.problems.append(f"{run}: history {history} is not each of {nodes} steps once")
    replies = Counter(
        (r["run_id"], r["join_id"])
        for r in await asyncio.to_thread(
            topic_records, settings.kafka_bootstrap, settings.merged_topic
        )
    )
    judge_joins(verdict, joined, runs, join_rows, replies)
    # the cache: each run's latest, or nothing
    async with RedisCheckpointCache.for_settings(settings) as cache:
        for f in (its[-1] for its in runs.values()):
            doc, _ = await cache.get(TENANT, f["run_id"], "latest")
            if doc is None:
                continue
            verdict.cache_entries += 1
            if (doc["seq"], doc["state_hash"]) != (f["seq"], f["state_hash"]):
                verdict.problems.append(
                    f"{f['run_id']}: the cache holds seq {doc['seq']}, PostgreSQL {f['seq']}"
                )
    return verdict


def judge_joins(
    verdict: Verdict,
    joined: list[dict[str, Any]],
    runs: dict[str, list[Any]],
    join_rows: list[Any],
    replies: Counter[tuple[str, str]],
) -> None:
    """Each join the orchestrator saw answered (``joined``): one merged checkpoint where
    its reply said, merging its round; every join on record (``join_rows``) answered on
    the reply topic (``replies``: records per run and join id); replies beyond the
    requests counted. ``runs``: each run's checkpoints in seq order."""
    verdict.joins = len(joined)
    recorded = {(r["run_id"], r["join_id"]): r for r in join_rows}
    answered = Counter(run for run, _ in recorded)
    for run, its in runs.items():
        merges = sum(1 for r in its if r["kind"] == "merge")
        if merges != (answers := answered[run]):
            verdict.problems.append(f"{run}: {merges} merged checkpoints for {answers} joins")
    for j in joined:
        key = (j["run"], j["join_id"])
        row = recorded.get(key)
        merges = [r for r in runs.get(j["run"], []) if r["kind"] == "merge"]
        if row is None or row["status"] != "ok" or row["checkpoint_seq"] != j["seq"]:
            verdict.problems.append(f"{key}: answered seq {j['seq']}, on record {row}")
        elif len(merges) <= j["round"] or merges[j["round"]]["seq"] != j["seq"]:
            verdict.problems.append(f"{key}: not the merge of round {j['round']}")
        else:
            history = json.loads(merges[j["round"]]["state"]).get("history")
            if history != list(range(2 * j["round"] + 2)):
                verdict.problems.append(f"{key}: merged history {history}")
        verdict.replies_repeated += max(0, replies[key] - j["requests"])
    unanswered = [key for key in recorded if replies[key] == 0]
    if unanswered:
        verdict.problems.append(f"{len(unanswered)} joins without a reply, e.g. {unanswered[:3]}")
