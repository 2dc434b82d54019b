"""The starvation watch (consumers/starvation.py): idle time counts only while a
partition is fetchable, a partition is looked at once per ``after_s`` of it, and it is
starved only when its leader's log ends past the position read."""

from __future__ import annotations

from aiokafka import TopicPartition

from alma_core.consumers.starvation import StarvationWatch

A, B, C = (TopicPartition("lifecycle", p) for p in range(3))


def test_idle_time_counts_only_polls_while_fetchable_and_records_reset_it() -> None:
    watch = StarvationWatch(after_s=10)
    for _ in range(4):
        watch.polled({A, B}, {B}, 2.0)  # B fed each time
    assert watch.idle == {A: 8.0, B: 0.0}
    watch.polled({B}, set(), 30.0)  # A held back (paused, retrying): its count ends
    assert A not in watch.idle
    watch.polled({A, B}, set(), 2.0)
    assert watch.idle[A] == 2.0  # from zero again
    assert watch.due() == [B]  # 32 s without records while fetchable


def test_a_due_partition_is_looked_at_once_then_counted_again() -> None:
    watch = StarvationWatch(after_s=5)
    watch.polled({A}, set(), 6.0)
    assert watch.due() == [A]
    assert watch.due() == []  # an idle topic is asked every after_s, not every loop
    watch.polled({A}, set(), 5.0)
    assert watch.due() == [A]


def test_starved_only_where_the_log_holds_records_past_the_position() -> None:
    positions = {A: 240, B: 100}  # C: nothing of it stored yet, position unknown
    ends = {A: 322, B: 100, C: 50}
    assert StarvationWatch.starved([A, B, C], positions, ends) == [A]
    assert StarvationWatch.starved([A], positions, {}) == []  # the leader did not say
