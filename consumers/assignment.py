"""What a member of a consumer group holds, and where each of its partitions stands.

The runtime's main loop is the one owner of this state; aiokafka's rebalance listener,
which runs in the coordinator's task while the loop may be inside a batch, only calls
:meth:`Assignment.noted` (no I/O: it pauses what it was given and notes it). Then:

* a partition is fetched only once **placed**: sought by the loop to where the store
  says it resumes (:meth:`Assignment.placed`), after its cache was invalidated if it
  moved here from another member;
* what is paused, and why, is decided in one place (:meth:`Assignment.sync_pauses`):
  everything while a batch is retried, otherwise the partitions not placed yet, those
  whose log ends before what the store applied (:meth:`Assignment.behind`), and those
  of a tenant over its rate quota (``consumers/throttle.py``). A
  partition paused for one reason is never resumed for another;
* each partition's **position** is where the consumer reads it from: the offset it
  was sent to, then the offset after the last record returned. Each record says it
  (``read_from``), so the store tells a hole in the log from records not read yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from alma_core.storage.offsets import PartitionKey, Progress


def key(tp: TopicPartition) -> PartitionKey:
    return (tp.topic, tp.partition)


class Membership:
    """Whether one consumer stayed the same member of its group: a member keeps its
    member id across rebalances; one whose session lapsed (cut off from the group's
    coordinator, or frozen, for a session) is given a new one when it joins again,
    static members (``group.instance.id``) included. By then another member may have
    applied its partitions, and its connections to the brokers may be stuck behind a
    cut (requests wait for TCP's retransmission, tens of seconds after the network is
    back): the runtime starts a new consumer, with new connections and nothing
    remembered (:mod:`alma_core.consumers.runtime`)."""

    def __init__(self) -> None:
        self.member_id: str | None = None
        self.lost = False

    def joined(self, member_id: str | None) -> None:
        """An assignment received as ``member_id`` (None or empty: not known)."""
        if not member_id:
            return
        if self.member_id is not None and member_id != self.member_id:
            self.lost = True
        self.member_id = member_id


class Assignment:
    def __init__(self) -> None:
        self.partitions: set[TopicPartition] = set()
        self.generation = 0  # one more at every assignment
        self.unplaced: set[TopicPartition] = set()  # assigned, not yet sought by the loop
        self.moved_here: set[TopicPartition] = set()  # their cache to invalidate first
        self.retrying = False  # a batch is being retried: nothing is fetched
        # partitions whose log ended before what the store applied: when first seen
        self.log_behind: dict[TopicPartition, float] = {}
        # where a partition's leader said its log ends when asked (:meth:`caught_up`):
        # aiokafka's high watermark is only updated by a fetch that brings records
        self.known_end: dict[TopicPartition, int] = {}
        self.throttled: set[TopicPartition] = set()  # their tenant is over its rate quota
        self.applied_to: dict[TopicPartition, int] = {}  # next offset the store expects
        # unknown where the store has no offset (Kafka's committed one was used)
        self.position: dict[TopicPartition, int] = {}

    def noted(self, consumer: AIOKafkaConsumer | None, assigned: set[TopicPartition]) -> None:
        """A new assignment (the listener's part): every partition of it is paused until
        placed. aiokafka starts each assignment afresh (from Kafka's committed offsets,
        nothing paused), partitions held before included."""
        self.moved_here = (self.moved_here | (assigned - self.partitions)) & assigned
        self.partitions = set(assigned)
        self.unplaced = set(assigned)
        self.generation += 1
        self.applied_to.clear()
        self.log_behind.clear()
        self.known_end.clear()
        self.throttled.clear()
        self.position.clear()
        if consumer is not None and assigned:
            consumer.pause(*assigned)

    def placed(
        self,
        consumer: AIOKafkaConsumer,
        partitions: Iterable[TopicPartition],
        stored: dict[PartitionKey, int],
    ) -> None:
        """Seek the partitions to their stored offsets (where there are), and let them
        be fetched."""
        for tp in partitions:
            offset = stored.get(key(tp))
            if offset is not None:
                consumer.seek(tp, offset)
                self.applied_to[tp] = offset
                self.position[tp] = offset
            self.moved_here.discard(tp)
            self.unplaced.discard(tp)
        self.sync_pauses(consumer)

    def sync_pauses(self, consumer: AIOKafkaConsumer) -> None:
        """What is fetched, decided in one place (see the module docstring)."""
        assignment = consumer.assignment()
        held = (
            set(assignment)
            if self.retrying
            else (self.unplaced | self.log_behind.keys() | self.throttled)
        )
        held &= assignment
        if held:
            consumer.pause(*held)
        if free := assignment - held:
            consumer.resume(*free)

    def behind(
        self, consumer: AIOKafkaConsumer, batch: dict[TopicPartition, list[Any]], now: float
    ) -> list[tuple[TopicPartition, int, int, bool]]:
        """Leave out of the batch, and pause, every partition whose log (its high
        watermark) ends before what the store already applied: (partition, applied to,
        high watermark, newly found). It stays paused until :meth:`caught_up` finds its
        log whole again (a leader change) or the next assignment reads the stored
        offsets again."""
        found = []
        for tp in consumer.assignment():
            applied, high = self.applied_to.get(tp), consumer.highwater(tp)
            if high is not None and tp in self.known_end:
                high = max(high, self.known_end[tp])
            if applied is None or high is None or applied <= high:
                continue
            batch.pop(tp, None)
            found.append((tp, applied, high, tp not in self.log_behind))
            self.log_behind.setdefault(tp, now)
        if any(new for *_, new in found):
            self.sync_pauses(consumer)
        return found

    def caught_up(
        self, consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]
    ) -> list[TopicPartition]:
        """Resume the partitions behind whose log now ends at or past what the store
        applied (``ends``: their high watermarks, asked of their leaders): a new leader's
        high watermark trails the old one's until its followers fetch again, so a
        leader change looks, for a moment, like a log that lost its end."""
        back = [
            tp
            for tp in self.log_behind
            if tp in ends and ends[tp] >= self.applied_to.get(tp, ends[tp] + 1)
        ]
        for tp in back:
            del self.log_behind[tp]
            self.known_end[tp] = ends[tp]
        if back:
            self.sync_pauses(consumer)
        return back

    def read(self, batch: dict[TopicPartition, list[Any]]) -> dict[PartitionKey, int]:
        """Where the consumer read each partition of this batch from (where it knows),
        its positions moved past the batch's records."""
        read_from = {key(tp): self.position[tp] for tp in batch if tp in self.position}
        for tp, records in batch.items():
            self.position[tp] = records[-1].offset + 1
        return read_from

    def put_back(self, consumer: AIOKafkaConsumer, batch: dict[TopicPartition, list[Any]]) -> None:
        """Records a poll returned that must not be consumed now: fetched again later."""
        for tp, records in batch.items():
            consumer.seek(tp, records[0].offset)

    def follow(
        self, consumer: AIOKafkaConsumer, progress: Progress
    ) -> dict[TopicPartition, tuple[int, int | None]]:
        """Follow a handled batch: partitions sent back are sought; returns, per partition
        still held, the next offset the store expects and the high watermark, for the
        offsets that may be committed and the lag."""
        owned = {key(tp): tp for tp in consumer.assignment()}
        for k, offset in progress.seeks.items():
            if k in owned:
                consumer.seek(owned[k], offset)
                self.position[owned[k]] = offset
        out = {}
        for k, offset in progress.next_offsets.items():
            if k in owned:
                tp = owned[k]
                self.applied_to[tp] = offset
                out[tp] = (offset, consumer.highwater(tp))
        return out
