"""Contract events and garbage through a real Kafka-protocol broker and the decoder."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from alma_core.schemas import NodeCompleted, Rejection, RejectReason, decode, encode
from tests.integration.conftest import Topics
from tests.services import Services


async def _read(bootstrap: str, topic: str, count: int) -> list[Any]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[Any] = []
    try:
        async with asyncio.timeout(30):
            while len(records) < count:
                batch = await consumer.getmany(timeout_ms=500)
                for rs in batch.values():
                    records.extend(rs)
    finally:
        await consumer.stop()
    return records


def _event(run_id: str, **payload: Any) -> dict[str, Any]:
    return {
        "event_id": f"{run_id}-e",
        "type": "node.completed",
        "emitted_at": "2026-11-22T10:00:00+00:00",
        "tenant_id": "acme",
        "workflow_id": "wf",
        "run_id": run_id,
        "node_id": "n1",
        "payload": payload,
    }


async def test_contract_event_round_trips(services: Services, topics: Topics) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        sent = decode(json.dumps(_event("run-1", updates={"step": 1})).encode())
        assert isinstance(sent, NodeCompleted)
        await producer.send_and_wait(topics.lifecycle, encode(sent), key=b"run-1")
    finally:
        await producer.stop()
    (record,) = await _read(services.kafka_bootstrap, topics.lifecycle, 1)
    received = decode(record.value, key=record.key)
    assert received == sent


async def test_garbage_gets_the_right_reasons(services: Services, topics: Topics) -> None:
    cases: list[tuple[bytes, bytes | None, RejectReason]] = [
        (b"\xff\xfebinary", b"r", RejectReason.NOT_UTF8),
        (b"{truncated", b"r", RejectReason.MALFORMED_JSON),
        (b'"just a string"', b"r", RejectReason.NOT_AN_OBJECT),
        (
            json.dumps({**_event("r", state={}), "type": "node.paused"}).encode(),
            b"r",
            RejectReason.UNKNOWN_TYPE,
        ),
        (
            json.dumps(_event("r", state={}, updates={})).encode(),
            b"r",
            RejectReason.SCHEMA_VIOLATION,
        ),
        (json.dumps(_event("r", state={"x": 1})).encode(), b"other", RejectReason.KEY_MISMATCH),
        (
            json.dumps(_event("r", state={"blob": "x" * 3000})).encode(),
            b"r",
            RejectReason.STATE_TOO_LARGE,
        ),
    ]
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap)
    await producer.start()
    try:
        for i, (value, key, _) in enumerate(cases):
            await producer.send_and_wait(topics.lifecycle, value, key=key, partition=i % 2)
        await producer.send_and_wait(topics.lifecycle, None, key=b"r", partition=0)
    finally:
        await producer.stop()
    records = await _read(services.kafka_bootstrap, topics.lifecycle, len(cases) + 1)
    by_value = {r.value: decode(r.value, key=r.key, max_state_bytes=2048) for r in records}
    for value, _, reason in cases:
        result = by_value[value]
        assert isinstance(result, Rejection), value[:40]
        assert result.reason == reason, result.describe()
    tombstone = by_value[None]
    assert isinstance(tombstone, Rejection)
    assert tombstone.reason == RejectReason.EMPTY
