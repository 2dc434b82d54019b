"""The inspector's addresses read and checked: a value it cannot use is a 400 naming
the parameter; the runs list's order and cursors, and the moment a walk by duration
takes running runs' durations at."""

from datetime import UTC, datetime, timedelta

import pytest
from starlette.exceptions import HTTPException

from alma_core.ui import params, views

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def _read(query: dict[str, str]) -> None:
    """What the runs list reads of its address."""
    params.run_filter("acme", query)
    params.listing(query, NOW)


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ({"sort": "colour"}, "created, duration, status"),
        ({"dir": "up"}, "asc or desc"),
        ({"status": "lost"}, "no status 'lost'"),
        ({"since": "yesterday"}, "since: not a time"),
        ({"sort": "duration", "after": views.cursor((5.0, NOW, "r")), "asof": "x"}, "asof"),
    ],
)
def test_an_address_the_list_cannot_use_is_a_400_that_says_why(
    query: dict[str, str], said: str
) -> None:
    with pytest.raises(HTTPException) as refused:
        _read(query)
    assert refused.value.status_code == 400
    assert said in str(refused.value.detail)


def test_a_walk_by_duration_takes_running_durations_at_its_first_page() -> None:
    first = params.listing({"sort": "duration"}, NOW)
    assert first.order.as_of == NOW
    assert (first.older_than, first.newer_than) == (None, None)
    assert first.query["asof"] == NOW.isoformat()  # its links carry the moment on
    later = NOW + timedelta(minutes=3)
    token = views.cursor((1500.0, NOW, "run-7"))
    second = params.listing({**first.query, "after": token}, later)
    assert second.order.as_of == NOW  # not when the later page was asked for
    assert second.older_than == (1500.0, NOW, "run-7")
    # a first page again (the sort's header, "first") takes a new moment
    assert params.listing({"sort": "duration", "asof": NOW.isoformat()}, later).order.as_of == later
    # other orders take none: a run's creation and status do not move
    assert params.listing({"sort": "status", "dir": "asc"}, later).order.as_of is None
    assert "asof" not in params.listing({}, later).query
    assert params.integer({"seq": "12"}, "seq") == 12
    with pytest.raises(HTTPException, match="whole number"):
        params.integer({"seq": "1.5"}, "seq")
    with pytest.raises(HTTPException, match="missing"):
        params.required({}, "id")
