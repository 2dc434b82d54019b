"""A partition that should be fetched and is not: the consumer is started again.

A placed partition that ALMA does not hold back (not awaiting placement, not behind its
stored offset, not throttled, no batch being retried) is fetched by the Kafka client.
It can still starve: aiokafka fetches nothing from a broker while a task updating the
fetch position of another partition led by it is in flight, and that task waits for the
group coordinator's committed offsets, which never come once its refresh task died on
an error it does not retry (seen in tests/cluster after a coordinator's broker was cut
off: one partition held for good, silently, while the others flowed). Whatever the
cause, the symptom is the same and can be checked: the partition's leader says its log
ends past the position ALMA read to, and polls for ``after_s`` of fetching time
brought none of it. Then the runtime leaves the group and joins again with a new
consumer (:mod:`alma_core.consumers.runtime`), which starts every partition afresh.

Pure: the accounting and the decision; the runtime asks the leaders.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiokafka import TopicPartition


class StarvationWatch:
    """How long each fetchable partition has gone without records, counted only over
    polls made while it was fetchable (a batch being applied, a storage retry or a
    pause does not count), and which are due a look at their leader's log end."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.idle: dict[TopicPartition, float] = {}

    def polled(
        self, fetchable: Iterable[TopicPartition], fed: Iterable[TopicPartition], seconds: float
    ) -> None:
        """A poll of ``seconds`` while ``fetchable`` could be fetched; ``fed``: those it
        brought records of. A partition not fetchable now starts from zero when it is
        again."""
        got = set(fed)
        self.idle = {tp: 0.0 if tp in got else self.idle.get(tp, 0.0) + seconds for tp in fetchable}

    def due(self) -> list[TopicPartition]:
        """The partitions idle for ``after_s`` of fetching: to be checked (once each,
        then counted from zero again: an idle topic is checked every ``after_s``)."""
        due = sorted(tp for tp, idle in self.idle.items() if idle >= self.after_s)
        for tp in due:
            self.idle[tp] = 0.0
        return due

    @staticmethod
    def starved(
        due: Iterable[TopicPartition],
        positions: Mapping[TopicPartition, int],
        ends: Mapping[TopicPartition, int],
    ) -> list[TopicPartition]:
        """Those of ``due`` whose log ends past the position ALMA read them to: records
        were there to fetch all along. A partition whose position ALMA does not know
        (nothing of it stored yet) is never called starved."""
        return [tp for tp in due if tp in positions and tp in ends and ends[tp] > positions[tp]]
