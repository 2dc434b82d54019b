"""The checkpointer's concurrent transactions, the pure parts: how a polled batch is
split (``partition_groups``) and what the handler does when one of them fails while
another commits. Against PostgreSQL: tests/integration/test_checkpointer.py
(``test_concurrent_transactions_keep_order_and_lose_nothing``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alma_core import errors
from alma_core.consumers import handler
from alma_core.consumers.handler import SPLIT_BYTES, StoreHandler, partition_groups
from alma_core.consumers.metrics import Metrics
from alma_core.schemas.decoder import decode
from alma_core.storage.batches import Batch, Committed, Effects, Incoming
from alma_core.storage.offsets import Progress
from tests.unit.test_isolation import Offsets, Sent


def incoming(partition: int, offset: int, run: str, tenant: str = "acme") -> Incoming:
    doc = {
        "event_id": f"e{partition}-{offset}",
        "type": "node.completed",
        "tenant_id": tenant,
        "emitted_at": "2026-11-24T10:00:00Z",
        "workflow_id": "wf",
        "run_id": run,
        "node_id": "n",
        "payload": {"state": {"i": offset}},
    }
    raw = json.dumps(doc).encode()
    return Incoming("lifecycle", partition, offset, None, raw, decode(raw))


# partition -> the runs of its records, in order
layouts = st.dictionaries(
    st.integers(0, 11),
    st.lists(st.sampled_from(["r0", "r1", "r2", "r3", "r4", "r5", "r6"]), max_size=8),
    max_size=12,
)


def batch_of(layout: dict[int, list[str]]) -> Batch:
    return {
        ("lifecycle", p): [incoming(p, i, run) for i, run in enumerate(runs)]
        for p, runs in layout.items()
    }


@given(layouts, st.integers(1, 6))
def test_every_partition_lands_in_one_group_whole_and_no_run_in_two(
    layout: dict[int, list[str]], n: int
) -> None:
    batch = batch_of(layout)
    groups = partition_groups(batch, n)
    if n == 1:
        assert groups == [batch]  # one transaction: the batch as polled
        return
    assert 1 <= len(groups) <= n
    busy = {tp for tp, records in batch.items() if records}
    placed = [tp for g in groups for tp in g]
    assert sorted(placed) == sorted(busy)  # each busy partition once, none invented
    for g in groups:
        for tp, records in g.items():
            assert records is batch[tp]  # whole, in its order
    owners: dict[str, int] = {}
    for i, g in enumerate(groups):
        for records in g.values():
            for r in records:
                assert owners.setdefault(r.decoded.run_id, i) == i  # type: ignore[union-attr]
    if len(groups) > 1:
        assert all(groups)  # no empty transaction


def test_independent_partitions_are_balanced_by_records() -> None:
    layout = {0: ["r0"] * 6, 1: ["r1"] * 3, 2: ["r2"] * 3, 3: ["r3"] * 1}
    groups = partition_groups(batch_of(layout), 2)
    sizes = sorted(sum(len(rs) for rs in g.values()) for g in groups)
    assert sizes == [6, 7]


def test_a_run_shared_by_partitions_keeps_them_together() -> None:
    layout = {0: ["r0", "shared"], 1: ["r1"], 2: ["shared", "r2"], 3: ["r3"]}
    groups = partition_groups(batch_of(layout), 4)
    (together,) = [g for g in groups if ("lifecycle", 0) in g]
    assert ("lifecycle", 2) in together
    assert len(groups) == 3


def test_one_group_is_the_batch_itself() -> None:
    batch = batch_of({0: ["r0"], 1: ["r1"]})
    assert partition_groups(batch, 1) == [batch]


@dataclass
class Raw:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


class Outage(Offsets):
    """A store whose transaction refuses partition 1 as an outage would, after
    partition 0's has committed."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: list[int] = []

    async def transact(self, cluster_id: str, batch: Batch, prepared: None) -> Committed[Effects]:
        (tp,) = batch
        if tp[1] == 1:
            await asyncio.sleep(0)  # partition 0's transaction is under way
            raise errors.StorageError("the server went away")
        self.next_offset[tp] = batch[tp][-1].offset + 1
        self.committed.append(tp[1])
        return Committed(Progress(next_offsets={tp: self.next_offset[tp]}), Effects())


class Split(StoreHandler[None, Effects]):
    """Two transactions a batch; what the post-commit step saw."""

    name = "test"

    def __init__(self, store: Offsets) -> None:
        super().__init__(
            store,
            None,
            Sent(),
            Metrics(),
            max_state_bytes=10_000,
            max_record_bytes=100_000,
            concurrency=2,
        )
        self.post_committed: list[dict[tuple[str, int], int]] = []

    async def prepare(self, incoming: Batch) -> tuple[Batch, None]:
        return incoming, None

    async def after_commit(self, applied: Committed[Effects]) -> None:
        self.post_committed.append(applied.progress.next_offsets)


def test_only_a_big_batch_is_split() -> None:
    """A second transaction pays off only where each carries SPLIT_BYTES of records."""
    h = Split(Offsets())
    small = batch_of({0: ["r0"] * 3, 1: ["r1"] * 3})
    assert h._transactions(small) == 1
    big = {
        tp: [replace(r, value=b"x" * (SPLIT_BYTES // 2)) for r in records]
        for tp, records in small.items()
    }  # 768 KB in all, 384 KB a partition: as many transactions as allowed
    assert h._transactions(big) == 2
    h.concurrency = 1
    assert h._transactions(big) == 1


async def test_a_failed_transaction_is_raised_after_the_others_are_post_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handler, "SPLIT_BYTES", 1)
    store = Outage()
    h = Split(store)
    raw = {
        ("lifecycle", p): [
            Raw("lifecycle", p, o, None, incoming(p, o, f"r{p}").value or b"") for o in range(3)
        ]
        for p in (0, 1)
    }
    with pytest.raises(errors.StorageError):
        await h.handle("c", raw)  # the runtime retries the batch: partition 0 is fenced
    assert store.committed == [0]
    assert h.post_committed == [{("lifecycle", 0): 3}]  # cache, outbox: not left for later
