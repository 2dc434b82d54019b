"""The garbage collector's pauses reach /metrics while a worker runs, and a worker
process can put its start-up objects out of the collector's sight."""

from __future__ import annotations

import gc

from alma_core.consumers.metrics import Metrics, gc_pauses
from alma_core.heap import freeze_heap


def full_collections(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("alma_gc_pause_seconds_count", {"generation": "2"})
    return value or 0.0


def test_every_collection_is_timed_while_watched_and_none_after() -> None:
    metrics = Metrics()
    with gc_pauses(metrics):
        gc.collect()
        gc.collect()
    timed = full_collections(metrics)
    assert timed == 2
    total = metrics.registry.get_sample_value("alma_gc_pause_seconds_sum", {"generation": "2"})
    assert total is not None
    assert total > 0
    gc.collect()  # the callback is gone with the block
    assert full_collections(metrics) == timed


def test_freezing_leaves_a_full_collection_nothing_of_what_was_alive() -> None:
    kept = [{"n": i} for i in range(20_000)]  # alive before the freeze
    try:
        frozen = freeze_heap()
        # a frozen object still dies when its last reference goes (another thread's,
        # in a full run: 2 of 792,941 once), so the count may only fall after the freeze
        assert frozen >= gc.get_freeze_count() >= len(kept)
        collected = {id(o) for o in gc.get_objects(generation=2)}
        assert id(kept) not in collected
        assert not {id(x) for x in kept} & collected
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
