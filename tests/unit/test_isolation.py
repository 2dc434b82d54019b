"""No record can stop a partition (docs/guarantees.md §5), the handler's part of it: when a batch
fails for its data (not for an outage), its records are applied one by one; the one
that fails alone is dead-lettered (``storage_rejected`` when PostgreSQL refused it,
``internal_error`` for a defect); if even its dead letter is refused, the partition
moves past it and the record goes to the dead-letter topic directly. An outage
(a retriable error) is never isolated: it goes up for the runtime to retry.

Pure logic with small stand-ins: a store that keeps its offsets in a dict and
refuses chosen offsets. The same paths run against PostgreSQL in
tests/integration/test_hostile.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from alma_core import errors
from alma_core.consumers.handler import StoreHandler
from alma_core.consumers.metrics import Metrics
from alma_core.schemas.decoder import Rejection, decode
from alma_core.storage.batches import Batch, BatchStore, Committed, Effects, Incoming
from alma_core.storage.dead_letters import dead_letter_for
from alma_core.storage.offsets import PartitionKey, Progress

TP = ("lifecycle", 0)


def record(offset: int) -> Incoming:
    doc = {
        "event_id": f"e{offset}",
        "type": "node.completed",
        "tenant_id": "acme",
        "emitted_at": "2026-11-23T10:00:00Z",
        "workflow_id": "wf",
        "run_id": "r",
        "node_id": "n",
        "payload": {"state": {"i": offset}},
    }
    raw = json.dumps(doc).encode()
    return Incoming(TP[0], TP[1], offset, b"r", raw, decode(raw, key=b"r"))


class Offsets(BatchStore[None, Effects, None]):
    """A store that keeps its offsets in a dict and applies what it is given, except
    batches holding ``data`` offsets (StorageRejected) or ``defect`` offsets (a bug),
    and, unless ``dead_letters``, any dead letter; every call's offsets in ``calls``."""

    def __init__(
        self,
        *,
        data: tuple[int, ...] = (),
        defect: tuple[int, ...] = (),
        dead_letters: bool = True,
        outage: bool = False,
    ) -> None:
        super().__init__(None, "group", consumer="test", dlq_topic="dlq")  # type: ignore[arg-type]
        self.next_offset: dict[PartitionKey, int] = {}
        self.calls: list[list[int]] = []
        self.data, self.defect = data, defect
        self.dead_letters, self.outage = dead_letters, outage

    async def stored_offsets(
        self, cluster_id: str, partitions: list[PartitionKey]
    ) -> dict[PartitionKey, int]:
        return {tp: self.next_offset[tp] for tp in partitions if tp in self.next_offset}

    async def transact(self, cluster_id: str, batch: Batch, prepared: None) -> Committed[Effects]:
        records = [r for rs in batch.values() for r in rs]
        self.calls.append([r.offset for r in records])
        if self.outage:
            raise errors.StorageError("the server is gone")
        for r in records:
            rejected = isinstance(r.decoded, Rejection)
            if rejected and not self.dead_letters:
                raise errors.StorageRejected("the dead-letter row was refused")
            if not rejected and r.offset in self.data:
                raise errors.StorageRejected("PostgreSQL refused the value")
            if not rejected and r.offset in self.defect:
                raise KeyError("a bug")
        letters = [
            dead_letter_for(r, r.decoded) for r in records if isinstance(r.decoded, Rejection)
        ]
        for tp, rs in batch.items():
            self.next_offset[tp] = max(r.offset for r in rs) + 1
        return Committed(Progress(next_offsets=dict(self.next_offset)), Effects(letters))

    async def skip(self, cluster_id: str, batch: Batch) -> tuple[Progress, bool]:
        progress, left = Progress(), False
        for tp, records in batch.items():
            fresh = [r for r in records if r.offset >= self.next_offset.get(tp, 0)]
            left = left or bool(fresh)
            self.next_offset[tp] = max(r.offset for r in records) + 1
            progress.next_offsets[tp] = self.next_offset[tp]
        return progress, left


@dataclass
class Sent:
    records: list[tuple[str, bytes | None, bytes, list[tuple[str, str]]]] = field(
        default_factory=list
    )

    async def publish(self, ids: list[int]) -> int:
        return 0

    async def send_now(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, str]]
    ) -> bool:
        self.records.append((topic, key, value, headers))
        return True

    async def sweep(self, *, force: bool = False) -> int:
        return 0


class Handler(StoreHandler[None, Effects]):
    name = "test"

    async def prepare(self, incoming: Batch) -> tuple[Batch, None]:
        return incoming, None


def handler(store: Offsets, relay: Sent | None = None) -> Handler:
    return Handler(
        store, None, relay or Sent(), Metrics(), max_state_bytes=10_000, max_record_bytes=100_000
    )


async def test_a_refused_record_is_dead_lettered_alone_and_the_rest_applied() -> None:
    store = Offsets(data=(1,), defect=(3,))
    outcomes = await handler(store).commit_or_isolate(
        "c", {TP: [record(i) for i in range(5)]}, None
    )
    calls = store.calls
    assert calls[0] == [0, 1, 2, 3, 4]  # the batch, refused
    assert [0] in calls
    assert [2] in calls
    assert [4] in calls  # the others, one by one, applied
    letters = [d for o in outcomes if o.effects for d in o.effects.dead_letters]
    assert [(d.record.offset, d.reason) for d in letters] == [
        (1, "storage_rejected"),
        (3, "internal_error"),
    ]
    assert letters[0].event_id == "e1"  # what its decoding found is kept
    assert store.next_offset[TP] == 5


async def test_a_refused_dead_letter_moves_the_partition_past_it_and_out_to_the_topic() -> None:
    store, relay = Offsets(data=(2,), dead_letters=False), Sent()
    h = handler(store, relay)
    outcomes = await h.commit_or_isolate("c", {TP: [record(i) for i in range(3)]}, None)
    assert store.next_offset[TP] == 3
    assert outcomes[-1].progress.next_offsets == {TP: 3}
    [(topic, key, value, headers)] = relay.records
    assert (topic, key) == ("dlq", b"r")
    assert json.loads(value)["event_id"] == "e2"  # the original bytes
    assert ("alma.dead_letter_stored", "false") in headers
    assert ("alma.reason", "storage_rejected") in headers
    failures = h.metrics.registry.get_sample_value(
        "alma_dead_letter_failures_total", {"consumer": "test"}
    )
    assert failures == 1


async def test_an_outage_is_never_isolated() -> None:
    store = Offsets(outage=True)
    with pytest.raises(errors.StorageError):
        await handler(store).commit_or_isolate("c", {TP: [record(i) for i in range(3)]}, None)
    assert store.calls == [[0, 1, 2]]  # no record tried alone, nothing dead-lettered
    assert store.next_offset == {}
