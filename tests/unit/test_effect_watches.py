"""The effect listener's bookkeeping (no connection is used): a run watched from
before an event's publish is waited on without a first read only for that event's
own run, on a listener still alive; what was expected and never waited for is
bounded; every watch leaves nothing behind."""

from __future__ import annotations

from typing import Any, cast

import asyncpg
import pytest

from alma_core.storage import effects
from alma_core.storage.effects import EffectListener, token


def listener() -> EffectListener:
    return EffectListener(cast(asyncpg.Connection, None))


def notify(lst: EffectListener, tenant: str, run: str) -> None:
    lst._notified(cast(Any, None), 0, effects.CHANNEL, token(tenant, run))


async def test_an_expected_event_is_waited_on_early_and_keeps_its_notification() -> None:
    lst = listener()
    lst.expect("e1", "acme", "r1")
    notify(lst, "acme", "r1")  # its commit, before anyone waits
    async with lst.watch("acme", "r1", "e1") as (woke, early):
        assert early
        assert woke.is_set()  # the notification that came before the wait is kept
    assert lst.early == 1
    assert lst._watchers == {}
    assert not lst._expected


@pytest.mark.parametrize(
    ("published", "waited"),
    [
        (("e1", "acme", "r1"), ("e2", "acme", "r1")),  # another event of the run
        (("e1", "acme", "r1"), ("e1", "acme", "r2")),  # the same id in another run
        (("e1", "acme", "r1"), ("e1", "other", "r1")),  # ... or another tenant
    ],
)
async def test_only_the_expected_event_of_its_own_run_skips_the_first_read(
    published: tuple[str, str, str], waited: tuple[str, str, str]
) -> None:
    lst = listener()
    lst.expect(*published)
    event_id, tenant, run = waited
    async with lst.watch(tenant, run, event_id) as (woke, early):
        assert not early
        assert not woke.is_set()
    if event_id == published[0]:  # taken by the watch, and dropped: it was not its run's
        assert not lst._expected
    assert lst.early == 0


async def test_a_lost_connection_makes_every_wait_read_first() -> None:
    lst = listener()
    lst.expect("e1", "acme", "r1")
    lst._lost(None)  # a notification may have been missed since
    async with lst.watch("acme", "r1", "e1") as (_, early):
        assert not early
        assert not lst.alive
    lst.expect("e2", "acme", "r1")  # a dead listener expects nothing
    assert not lst._expected
    assert lst._watchers == {}


def test_events_expected_and_never_waited_for_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(effects, "EXPECTED_KEPT", 3)
    lst = listener()
    for i in range(5):
        lst.expect(f"e{i}", "acme", f"r{i}")
    assert list(lst._expected) == ["e2", "e3", "e4"]
    assert set(lst._watchers) == {token("acme", f"r{i}") for i in (2, 3, 4)}
    lst.forget("e3")  # its publish failed
    lst.forget("e3")  # twice is harmless
    assert list(lst._expected) == ["e2", "e4"]
    assert set(lst._watchers) == {token("acme", f"r{i}") for i in (2, 4)}
