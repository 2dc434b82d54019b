"""What a member pauses when a partition's log seems to end before what the store
applied: found on a three-broker cluster (tests/cluster), where a SIGKILLed leader's
successor answered with a high watermark one record short of what the old leader had
let the group apply. The partition was paused for good (until the next rebalance), and
every later event of its runs waited; it must resume once its leader says the log
reaches the applied offset, and a stale high watermark must not pause it again."""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition

from alma_core.consumers.assignment import Assignment, Membership

TP = TopicPartition("lifecycle", 1)


class Consumer:
    """The part of aiokafka's consumer that :class:`Assignment` reads and sets."""

    def __init__(self, highwater: int) -> None:
        self.high = highwater
        self.held: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    def highwater(self, tp: TopicPartition) -> int:
        return self.high

    def pause(self, *tps: TopicPartition) -> None:
        self.held.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.held.difference_update(tps)


def placed_at(consumer: Any, offset: int) -> Assignment:
    a = Assignment()
    a.noted(consumer, {TP})
    consumer.seek = lambda tp, o: None
    a.placed(consumer, [TP], {("lifecycle", 1): offset})
    return a


def test_a_leader_change_pauses_for_a_moment_only() -> None:
    consumer = Consumer(highwater=5)  # the new leader's high watermark trails by one
    a = placed_at(consumer, 6)
    assert TP not in consumer.held
    found = a.behind(consumer, {}, now=0.0)  # type: ignore[arg-type]
    assert [(tp, applied, high, new) for tp, applied, high, new in found] == [(TP, 6, 5, True)]
    assert TP in consumer.held
    # the leader asked again: still short, the partition stays paused
    assert a.caught_up(consumer, {TP: 5}) == []  # type: ignore[arg-type]
    assert TP in consumer.held
    # its followers fetched: the log reaches what was applied, the partition resumes
    assert a.caught_up(consumer, {TP: 6}) == [TP]  # type: ignore[arg-type]
    assert TP not in consumer.held
    # aiokafka's own high watermark is still the stale one: no pause again
    assert a.behind(consumer, {}, now=1.0) == []  # type: ignore[arg-type]
    assert TP not in consumer.held


def test_a_log_that_really_ends_early_stays_paused_and_keeps_its_first_sighting() -> None:
    consumer = Consumer(highwater=3)
    a = placed_at(consumer, 1000)
    a.behind(consumer, {}, now=10.0)  # type: ignore[arg-type]
    again = a.behind(consumer, {}, now=11.0)  # type: ignore[arg-type]
    assert [new for *_, new in again] == [False]
    assert a.log_behind == {TP: 10.0}  # the grace counts from the first sighting
    assert a.caught_up(consumer, {TP: 3}) == []  # type: ignore[arg-type]
    assert TP in consumer.held
    # a new assignment starts afresh: its stored offsets are read again
    a.noted(consumer, {TP})  # type: ignore[arg-type]
    assert a.log_behind == {}
    assert a.known_end == {}


def test_a_member_given_a_new_member_id_has_lost_its_membership() -> None:
    """Rebalances keep a member's id; a session that lapsed (cut off, frozen) gives it a
    new one when it joins again, static members too: then it has lost its membership."""
    m = Membership()
    m.joined("w1-aaa")
    m.joined("w1-aaa")  # a rebalance: the same member
    m.joined(None)  # not known: nothing said
    assert not m.lost
    m.joined("w1-bbb")  # the same instance, joined again after its session lapsed
    assert m.lost
    assert m.member_id == "w1-bbb"
