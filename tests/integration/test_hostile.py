"""Guarantee 5 under hostile input: records an independent producer can send (NUL in
every string field and in keys, lone surrogates, huge integers, NaN and Infinity, deep
nesting, oversized values, invalid UTF-8 in headers) interleaved with good events,
through every consumer group. The good events are all applied, the bad ones are all
dead-lettered with their bytes kept exactly, and no partition stops. When even the
dead-letter row cannot be written, the record still reaches the dead-letter topic, the
partition moves on and a metric counts it; a read-only or failing server pauses the
pipeline instead of dead-lettering good events."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from alma_core.settings import Settings
from alma_core.storage.embeddings import AsyncEmbedder
from tests.integration.harness import (
    Publisher,
    Worker,
    completed,
    count,
    event,
    fetch,
    read_topic,
    wait_for,
)

BAD_HEADERS = [("trace", b"\xff\xfe\x00bad"), ("\u00e9t\u00e9", b"\xc3\x28")]


def _raw(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def _with(doc: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**doc, **fields, "event_id": fields.get("event_id", doc["event_id"] + "x")}


def hostile_lifecycle(run: str, max_record_bytes: int) -> list[tuple[bytes, bytes | None]]:
    """(value, key) pairs no decoder or database may choke on. Each must be dead-lettered."""
    good = completed(run, state={"ok": 1})
    records: list[tuple[bytes, bytes | None]] = []
    for field in ("event_id", "run_id", "tenant_id", "workflow_id", "node_id", "branch_id"):
        records.append((_raw(_with(good, **{field: "a\u0000b"})), run.encode()))
    records += [
        (_raw(completed(run, state={"k": "v\u0000"})), run.encode()),
        (_raw(completed(run, state={"k\u0000": 1})), run.encode()),
        (_raw(completed(run, metadata={"note": "\u0000"}, state={"a": 1})), run.encode()),
        (_raw(good).replace(good["event_id"].encode(), b"\\ud800"), run.encode()),
        (_raw(completed(run, state={"a": 1}, expected_seq=10**40)), run.encode()),
        (_raw(completed(run, state={"a": 1})), b"other\x00key"),
        (_raw(completed(run, state={"a": 1})).replace(b'{"a": 1}', b'{"a": NaN}'), run.encode()),
        (
            _raw(completed(run, state={"a": 1})).replace(b'{"a": 1}', b'{"a": Infinity}'),
            run.encode(),
        ),
        (
            _raw(completed(run, state={"a": 1})).replace(b'{"a": 1}', b"[" * 5000 + b"]" * 5000),
            run.encode(),
        ),
        (b"\xff\xfe{not utf-8", run.encode()),
        (b"x" * (max_record_bytes + 1), run.encode()),
        (b"\x00\x00\x00", b"\x00"),
    ]
    return records


async def _dead_letter_values(dsn: str) -> list[bytes]:
    rows = await fetch(dsn, "SELECT value FROM dead_letters ORDER BY source_offset")
    return [bytes(r["value"]) for r in rows]


async def test_hostile_records_through_the_checkpointer(settings: Settings, worker: Worker) -> None:
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    run = "victim"
    poison = hostile_lifecycle(run, settings.max_record_bytes)
    good: list[dict[str, Any]] = []
    async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
        for i, (value, key) in enumerate(poison):
            doc = completed(run, state={"i": i, "big": 10**40})
            good.append(doc)
            await pub.send(doc, headers=BAD_HEADERS)
            await pub.send(value, key=key, headers=BAD_HEADERS)
        last = completed(run, state={"i": "last"})
        good.append(last)
        await pub.send(last)
        await pub.flush()

    async def all_dead() -> int:
        return await count(dsn, "SELECT count(*) FROM dead_letters") == len(poison)

    await wait_for(all_dead, what="every hostile record dead-lettered", limit_s=90)

    async def all_good() -> bool:
        return await count(dsn, "SELECT count(*) FROM run_events") == len(good)

    await wait_for(all_good, what="every good event applied")
    rows = await fetch(
        dsn, "SELECT event_id, state FROM checkpoints WHERE run_id = $1 ORDER BY seq", run
    )
    assert [r["event_id"] for r in rows] == [g["event_id"] for g in good]
    assert rows[0]["state"]["big"] == 10**40
    assert sorted(await _dead_letter_values(dsn)) == sorted(v for v, _ in poison)
    keys = await fetch(dsn, "SELECT key FROM dead_letters")
    assert sorted(bytes(r["key"]) for r in keys) == sorted(k or b"" for _, k in poison)
    dlq = await read_topic(bootstrap, settings.dlq_topic, len(poison), limit_s=60)
    assert sorted(r.value for r in dlq) == sorted(v for v, _ in poison)
    for record in dlq:  # the headers name the reason, readable as UTF-8
        for _, value in record.headers:
            value.decode("utf-8")
    assert worker.value("alma_dead_letter_failures_total", {"consumer": "checkpointer"}) == 0


async def test_hostile_handoffs_through_the_joiner_and_the_learner(
    settings: Settings, embedder: AsyncEmbedder
) -> None:
    """The joiner and the learner read the hand-off topic: hostile records there are
    dead-lettered by both, and the good join and completion around them take effect."""
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    run = "handoff"
    poison = hostile_lifecycle(run, settings.max_record_bytes)
    async with Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder):
        async with Publisher(bootstrap, settings.sequenced_topic) as pub:
            for value, key in poison:
                await pub.send(value, key=key, headers=BAD_HEADERS)
            await pub.flush()
        async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
            await pub.send(completed(run, branch="a", state={"xs": [1]}))
            await pub.send(completed(run, branch="b", state={"xs": [2]}))
            await pub.send(
                event(
                    "branch.join",
                    run,
                    join_id="j1",
                    branch_ids=["a", "b"],
                    reducers={"xs": "append"},
                )
            )
            await pub.send(
                event(
                    "workflow.completed",
                    run,
                    node=None,
                    outcome="success",
                    duration_ms=5,
                    node_count=2,
                    nodes_succeeded=2,
                    nodes_failed=0,
                    task="hostile neighbours",
                )
            )
            await pub.flush()

        async def done() -> bool:
            merged = await count(dsn, "SELECT count(*) FROM checkpoints WHERE kind = 'merge'")
            learned = await count(dsn, "SELECT count(*) FROM workflow_outcomes")
            dead = await count(dsn, "SELECT count(*) FROM dead_letters")
            return merged == 1 and learned == 1 and dead == 2 * len(poison)

        await wait_for(
            done, what="the join, the outcome and both groups' dead letters", limit_s=120
        )
    rows = await fetch(dsn, "SELECT consumer, value FROM dead_letters")
    for consumer in ("joiner", "learner"):
        values = sorted(bytes(r["value"]) for r in rows if r["consumer"] == consumer)
        assert values == sorted(v for v, _ in poison), consumer


async def _refuse_dead_letters_of(dsn: str, marker: str) -> None:
    """A real trigger that refuses some dead-letter rows (a stand-in for a database that
    cannot take them: a broken constraint, a full tablespace for that table)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"""
            CREATE FUNCTION refuse_marked() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF position(convert_to('{marker}', 'UTF8') IN NEW.value) > 0 THEN
                RAISE EXCEPTION 'dead letter refused for the test';
              END IF;
              RETURN NEW;
            END $$;
            CREATE TRIGGER refuse_marked BEFORE INSERT ON dead_letters
              FOR EACH ROW EXECUTE FUNCTION refuse_marked();""")
    finally:
        await conn.close()


async def test_a_dead_letter_that_cannot_be_stored_still_moves_on(
    settings: Settings, worker: Worker
) -> None:
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    await _refuse_dead_letters_of(dsn, "refuse-me")
    run = "last-resort"
    bad = b'{"refuse-me": true'
    before, after = completed(run, state={"n": 1}), completed(run, state={"n": 2})
    async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
        await pub.send(before)
        await pub.send(bad, key=run)
        await pub.send(after)
        await pub.flush()

    async def both() -> bool:
        return await count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id = $1", run) == 2

    await wait_for(both, what="the events on both sides of the unstorable dead letter")
    dlq = await read_topic(bootstrap, settings.dlq_topic, 1)
    assert dlq[0].value == bad
    headers = {k: v.decode() for k, v in dlq[0].headers}
    assert headers["alma.reason"] == "malformed_json"
    assert headers["alma.dead_letter_stored"] == "false"
    assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0
    assert worker.value("alma_dead_letter_failures_total", {"consumer": "checkpointer"}) == 1


async def test_a_read_only_database_pauses_instead_of_dead_lettering(
    settings: Settings, worker: Worker
) -> None:
    """A failover to a read-only replica (SQLSTATE 25006) is the server's state, not the
    record's: the batch waits and is applied once the server takes writes again."""
    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("""
            CREATE TABLE read_only_switch (on_ boolean NOT NULL);
            INSERT INTO read_only_switch VALUES (true);
            CREATE FUNCTION read_only() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF (SELECT on_ FROM read_only_switch) THEN
                RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction'
                  USING ERRCODE = 'read_only_sql_transaction';
              END IF;
              RETURN NEW;
            END $$;
            CREATE TRIGGER read_only BEFORE INSERT ON checkpoints
              FOR EACH ROW EXECUTE FUNCTION read_only();""")
        run = "failover"
        async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
            await pub.send(completed(run, state={"n": 1}))
            await pub.flush()

        async def retried() -> bool:
            return worker.value("alma_storage_retries_total", {"consumer": "checkpointer"}) >= 2

        await wait_for(retried, what="the checkpointer retrying")
        await conn.execute("UPDATE read_only_switch SET on_ = false")

        async def applied() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id = $1", run) == 1

        await wait_for(applied, what="the checkpoint once the database takes writes")
        assert await count(dsn, "SELECT count(*) FROM dead_letters") == 0
    finally:
        await conn.close()
