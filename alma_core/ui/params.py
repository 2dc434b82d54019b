"""What a page's address asks for, read and checked: a value the inspector cannot use
is a 400 that names the parameter and says what it takes, never a guess. Pure: a
request's query in, plain values out (the runs list's filter and order included)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from starlette.exceptions import HTTPException

from alma_core.sequencing import SHOWN_STATUSES
from alma_core.storage import runs
from alma_core.ui import views


def required(q: Mapping[str, str], name: str) -> str:
    value = q.get(name)
    if not value:
        raise HTTPException(400, f"missing ?{name}=")
    return value


def integer(q: Mapping[str, str], name: str) -> int:
    return whole(required(q, name), name)


def whole(raw: str, name: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise HTTPException(400, f"{name} must be a whole number, got {raw[:40]!r}") from None
    if not -(2**63) <= value < 2**63:
        raise HTTPException(400, f"{name} is out of range")
    return value


def moment(raw: str | None, name: str) -> datetime | None:
    """A time from a form (``datetime-local``: no zone, taken as UTC)."""
    if not raw:
        return None
    try:
        at = datetime.fromisoformat(raw)
    except ValueError:
        raise HTTPException(
            400, f"{name}: not a time ({raw[:40]!r}); use 2026-11-26T14:30"
        ) from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def run_filter(tenant: str, q: Mapping[str, str]) -> runs.RunFilter:
    """The runs list's filters (``workflow``, ``status``, ``since``, ``until``, ``q``,
    ``node``, ``error``)."""
    status = q.get("status") or None
    if status is not None and status not in SHOWN_STATUSES:
        raise HTTPException(400, f"no status {status!r}: one of {', '.join(SHOWN_STATUSES)}")
    return runs.RunFilter(
        tenant_id=tenant,
        workflow_id=q.get("workflow") or None,
        status=status,
        since=moment(q.get("since"), "since"),
        until=moment(q.get("until"), "until"),
        text=q.get("q") or None,
        node=q.get("node") or None,
        error=q.get("error") or None,
    )


@dataclasses.dataclass(frozen=True)
class Listing:
    """Where in the runs list a page is: its order, the cursor it pages from (``after``
    going on, ``newer`` going back; neither on the first page), and the address the
    page's own links keep (its ``asof`` pinned when sorted by duration)."""

    order: runs.Order
    older_than: tuple[Any, ...] | None
    newer_than: tuple[Any, ...] | None
    query: dict[str, str]


def listing(q: Mapping[str, str], now: datetime) -> Listing:
    """The runs list's order from its address (``sort``, ``dir``: newest first when
    neither is given) and its cursors. Sorted by duration, the first page takes running
    runs' durations at ``now`` and its links carry that moment on (``asof``), so every
    page of one walk shares it."""
    sort, direction = q.get("sort"), q.get("dir")
    if sort and sort not in runs.SORTS:
        raise HTTPException(400, f"no sort {sort!r}: one of {', '.join(runs.SORTS)}")
    if direction and direction not in ("asc", "desc"):
        raise HTTPException(400, f"no dir {direction!r}: asc or desc")
    order = runs.Order(sort or "created", ascending=direction == "asc")
    older_than = views.parse_cursor(q.get("after"), order.sort)
    newer_than = views.parse_cursor(q.get("newer"), order.sort)
    query = dict(q)
    if order.sort == "duration":
        paging = older_than is not None or newer_than is not None
        as_of = (moment(q.get("asof"), "asof") if paging else None) or now
        order = dataclasses.replace(order, as_of=as_of)
        query["asof"] = as_of.isoformat()
    return Listing(order, older_than, newer_than, query)
