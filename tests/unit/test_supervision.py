"""`alma up`'s decisions about its embedded services, the pure parts: when a service
that died is started again (and when it is given up), and when the broker's growth is
worth a warning. Against real processes: tests/integration/test_embedded.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from alma_core.cli.embedded_supervisor import Limits, RestartPolicy, Watch


def test_restarts_back_off_and_give_up_past_the_limit() -> None:
    policy = RestartPolicy(limit=3, window_s=600, initial_s=0.5, max_s=1.5)
    assert policy.delay([], 1000) == 0.5
    assert policy.delay([990], 1000) == 1.0
    assert policy.delay([980, 990], 1000) == 1.5  # capped
    assert policy.delay([970, 980, 990], 1000) is None  # the limit within the window
    assert policy.delay([100, 200, 990], 1000) == 1.0  # old restarts are forgotten
    assert RestartPolicy(limit=0).delay([], 0) is None  # never restart


@dataclass
class Stack:
    """What the watch reads of a stack: its services and which is the broker."""

    services: list[Any] = field(default_factory=list)
    broker: Any = field(default_factory=lambda: SimpleNamespace(in_memory=True))  # Tansu


def test_the_broker_is_warned_about_once_and_again_at_each_doubling() -> None:
    heard: list[str] = []
    lengths: dict[tuple[str, int], int] = {("alma.lifecycle.v1", 3): 100}
    seen: dict[tuple[str, int], int] = {}
    watch = Watch(
        Stack(),  # type: ignore[arg-type]
        notify=heard.append,
        memory=lambda _name, _held: None,
        logs=lambda: dict(lengths),
        log_length=lambda t, p, n: seen.__setitem__((t, p), n),
        limits=Limits(broker_bytes=1 << 30, partition_records=1000),
    )
    watch.sample()
    assert (heard, seen) == ([], {("alma.lifecycle.v1", 3): 100})
    lengths[("alma.lifecycle.v1", 3)] = 1200
    watch.sample()
    watch.sample()
    assert len(heard) == 1
    assert "partition 3 of alma.lifecycle.v1 1,200 records" in heard[0]
    assert "ALMA_KAFKA_BOOTSTRAP" in heard[0]
    lengths[("alma.lifecycle.v1", 3)] = 2500
    watch.sample()
    assert len(heard) == 2


@pytest.mark.parametrize(
    "broker", [None, SimpleNamespace(in_memory=False)], ids=["configured", "apache-kafka"]
)
def test_a_broker_that_keeps_its_log_on_disk_is_never_warned_about(broker: Any) -> None:
    heard: list[str] = []
    seen: dict[tuple[str, int], int] = {}
    watch = Watch(
        Stack(broker=broker),  # type: ignore[arg-type]
        notify=heard.append,
        memory=lambda _name, _held: None,
        logs=lambda: {("t", 0): 10**6},
        log_length=lambda t, p, n: seen.__setitem__((t, p), n),
        limits=Limits(partition_records=10),
    )
    watch.sample()
    assert heard == []
    assert seen == {("t", 0): 10**6}  # still sampled for the metrics
