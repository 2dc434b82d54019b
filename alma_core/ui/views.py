"""What the run inspector shows, in pure code: a run's timeline laid out by branch,
values and raw bytes made safe to show (escaped by the templates, cut here), and the
list's paging cursor. No I/O: unit-tested (tests/unit/test_ui_views.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from alma_core.text import visible as _visible

MAIN_LANE = "main"
SHOWN_CHARS = 20_000  # of a state or record on a page; the rest is cut, and said so
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Shown:
    """Text to show: at most ``SHOWN_CHARS`` of it, and how much was cut."""

    text: str
    cut: int = 0
    total: int = 0


def _cut(text: str, limit: int) -> Shown:
    if len(text) <= limit:
        return Shown(text, 0, len(text))
    return Shown(text[:limit], len(text) - limit, len(text))


def shown_json(value: Any, limit: int = SHOWN_CHARS) -> Shown:
    """A JSON value, indented; control characters escaped (``\\u0000`` stays text)."""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
    return _cut(_visible(text), limit)


def shown_bytes(raw: bytes | None, limit: int = SHOWN_CHARS) -> Shown:
    """Raw bytes as text: UTF-8 where they are, ``\\xNN`` where they are not, control
    characters (NUL included) as escapes; None as empty."""
    if raw is None:
        return Shown("", 0, 0)
    text = raw.decode("utf-8", "backslashreplace")
    return _cut(_visible(text), limit)


def visible(value: Any) -> Any:
    """Every value a template shows (Jinja's ``finalize``): text with its control and
    bidirectional characters as escapes; markup the templates made (``__html__``: a
    macro's output, already escaped and made visible) and anything else as it is."""
    if isinstance(value, str) and not hasattr(value, "__html__"):
        return _visible(value)
    return value


_DIGIT_RUNS = re.compile(r"(\d+)")


def natural(key: object) -> tuple[tuple[int, int, str], ...]:
    """A field name's place in natural order: its runs of digits compared as numbers
    ("step2" before "step10"), the rest as text, digits before letters."""
    parts = _DIGIT_RUNS.split(str(key))  # odd places: the runs of digits
    return tuple((0, int(p), "") if i % 2 else (1, 0, p) for i, p in enumerate(parts) if p)


def fields_in_order(state: Mapping[str, Any], containing: str = "") -> list[tuple[str, Any]]:
    """A state's top-level fields in natural order; with ``containing``, only those whose
    name contains it, in any case."""
    wanted = containing.casefold()
    found = (kv for kv in state.items() if wanted in str(kv[0]).casefold())
    return sorted(found, key=lambda kv: natural(kv[0]))


def counted(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1: "1 run", "2 runs"."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


# what each kind of retrieved item is called on the memory page, in one style
KIND_LABELS = {
    "heuristic": "heuristic",
    "anti_pattern": "anti-pattern",
    "domain_knowledge": "domain knowledge",
    "preference": "preference",
    "outcome": "node outcome",
    "WorkflowOutcome": "run outcome",
}


@dataclass(frozen=True)
class MemoryRow:
    """One line of the memory page's table: a fact, its best score and how many
    retrieved items state it."""

    kind: str
    score: float
    content: str
    times: int = 1


def memory_rows(items: Iterable[Mapping[str, Any]]) -> list[MemoryRow]:
    """Retrieved items (``MemorySlice.to_doc``'s, best first) as the table shows them:
    each labelled in one style, and items of one kind that say the same thing (three
    runs' identical node outcomes) one row with its count, at the best score."""
    rows: dict[tuple[str, str], MemoryRow] = {}
    for item in items:
        raw = item.get("kind") or item.get("type") or ""
        kind = KIND_LABELS.get(str(raw), str(raw).replace("_", " "))
        content = str(item.get("content") or item.get("description") or "")
        key = (kind, content)
        if key in rows:
            seen = rows[key]
            rows[key] = MemoryRow(
                kind, max(seen.score, float(item["score"])), content, seen.times + 1
            )
        else:
            rows[key] = MemoryRow(kind, float(item["score"]), content)
    return list(rows.values())


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether a request's ``Host`` (a name or address, a port perhaps, IPv6 in
    brackets) names one of ``allowed``: exact names, ``*.example.com`` for its
    subdomains, ``*`` for any. Against DNS rebinding: a page of another site whose name
    resolves to this address sends its own name."""
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:
        return False
    if not name:
        return False
    for pattern in (a.lower().strip("[]") for a in allowed):
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


@dataclass
class Item:
    """One thing on a run's timeline, in its lane (a branch, the main line, the dead
    letters or the run's end)."""

    lane: str
    kind: str  # node, failure, merge, dead_letter, refused_join, completed
    at: datetime | None
    seq: int | None = None
    title: str = ""
    detail: str = ""
    link: str | None = None
    took_ms: float | None = None  # how long the node ran (from its events), where known


@dataclass
class Timeline:
    lanes: list[str]
    items: list[Item] = field(default_factory=list)

    def rows(self) -> list[tuple[Item, int]]:
        """Each item with its lane's column, in order."""
        column = {lane: i for i, lane in enumerate(self.lanes)}
        return [(item, column[item.lane]) for item in self.items]


def timeline(
    checkpoints: Iterable[Mapping[str, Any]],
    joins: Iterable[Mapping[str, Any]],
    dead_letters: Iterable[Mapping[str, Any]],
    completion: Mapping[str, Any] | None,
    *,
    link: str,
    took: Mapping[str, float] | None = None,
) -> Timeline:
    """A run's timeline: its checkpoints in seq order, each in its branch's lane (the
    main line first, then branches as they began); its refused joins and dead letters
    placed by time among them; its completion last. ``link`` formats a checkpoint's
    address from its seq (``{seq}``); ``took`` gives how long the node whose event made a
    checkpoint ran, by event id (:func:`steps`)."""
    took = took or {}
    items: list[Item] = []
    lanes: dict[str, None] = {MAIN_LANE: None}
    for cp in checkpoints:
        lane = cp["branch_id"] or MAIN_LANE
        lanes.setdefault(lane, None)
        kind = cp["kind"]
        if kind == "failure":
            attempt = f" (attempt {cp['attempt']})" if cp.get("attempt") is not None else ""
            title = f"{cp['node_id'] or '?'} failed{attempt}"
            detail = f"{cp.get('error_type') or 'error'}: {cp.get('error_message') or ''}"
        elif kind == "merge":
            title = f"merge of {', '.join(f'#{s}' for s in cp.get('merged_from') or [])}"
            detail = f"node {cp['node_id']}" if cp.get("node_id") else ""
        else:
            title = cp["node_id"] or "(no node)"
            detail = f"{cp['size_bytes']} bytes" if cp.get("size_bytes") is not None else ""
        ran = took.get(cp.get("event_id") or "")
        at, seq = cp["created_at"], cp["seq"]
        items.append(Item(lane, kind, at, seq, title, detail, link.format(seq=seq), ran))
    extras: list[Item] = []
    for j in joins:
        if j["status"] != "ok":
            extras.append(
                Item("joins", "refused_join", j["created_at"], None, f"join {j['join_id']} refused")
            )
    for d in dead_letters:
        extras.append(
            Item(
                "dead letters", "dead_letter", d["created_at"], None, d["reason"], d["detail"] or ""
            )
        )
    if extras:
        for extra in extras:
            lanes.setdefault(extra.lane, None)
        items = _by_time(items, extras)
    if completion is not None:
        lanes.setdefault("end", None)
        outcome = completion.get("outcome") or "completed"
        items.append(Item("end", "completed", completion.get("at"), None, f"run {outcome}"))
    return Timeline(list(lanes), items)


def _by_time(ordered: list[Item], extras: list[Item]) -> list[Item]:
    """``ordered`` (in seq order) with ``extras`` each placed before the first item later
    than it; seq order is never changed."""
    out: list[Item] = []
    pending = sorted(extras, key=lambda i: (i.at is None, i.at or datetime.min))
    for item in ordered:
        while (
            pending
            and item.at is not None
            and pending[0].at is not None
            and pending[0].at < item.at
        ):
            out.append(pending.pop(0))
        out.append(item)
    return out + pending


def cursor(key: tuple[Any, ...]) -> str:
    """The list's next-page token: where the last run shown sits in the list's order
    (:meth:`alma_core.storage.runs.Order.key`: its sort key, if any, its creation and
    its id)."""
    *sort_key, created_at, run_id = key
    return "|".join([*(str(v) for v in sort_key), created_at.isoformat(), run_id])


# what a sort's key is read back as (created: none beyond the creation itself)
_SORT_KEY_TYPES: dict[str, Callable[[str], Any]] = {"duration": float, "status": int}


def parse_cursor(token: str | None, sort: str = "created") -> tuple[Any, ...] | None:
    """A next-page token of a list sorted by ``sort`` back; None for none or one not
    ours (the first page)."""
    read = _SORT_KEY_TYPES.get(sort)
    parts = (token or "").split("|", 1 if read is None else 2)
    if len(parts) != (2 if read is None else 3):
        return None
    try:
        sort_key = () if read is None else (read(parts[0]),)
        return (*sort_key, datetime.fromisoformat(parts[-2]), parts[-1])
    except ValueError:
        return None


@dataclass(frozen=True)
class Step:
    """One event of a run's history: what it was, when it was sent and recorded, what
    it did, and (for a node's end) how long the node ran."""

    index: int  # from 1, in the order the run recorded its events
    event_id: str
    type: str
    node_id: str | None
    branch_id: str | None
    attempt: int | None
    emitted_at: datetime | None
    recorded_at: datetime | None
    effect: str
    seq: int | None
    took_ms: float | None  # node.completed/failed: since its node.started; the run's own


def steps(events: Iterable[Mapping[str, Any]]) -> list[Step]:
    """A run's events as its history. A node's end (``node.completed`` or
    ``node.failed``) took the time since the latest ``node.started`` of the same node
    and branch before it, both by the publisher's clock (``emitted_at``); a
    ``workflow.completed`` took the duration it reports (``duration_ms``). ``attempt``
    is the event's own, where it gave one."""
    started: dict[tuple[str | None, str | None], datetime] = {}
    out: list[Step] = []
    for i, e in enumerate(events, start=1):
        at = e.get("emitted_at")
        where = (e.get("node_id"), e.get("branch_id"))
        took: float | None = None
        kind = e["type"]
        if kind == "node.started" and at is not None:
            started[where] = at
        elif kind in ("node.completed", "node.failed") and at is not None and where in started:
            took = (at - started.pop(where)).total_seconds() * 1000
        elif kind == "workflow.completed" and e.get("duration_ms") is not None:
            took = float(e["duration_ms"])
        attempt = e.get("attempt")
        out.append(
            Step(
                index=i,
                event_id=e["event_id"],
                type=kind,
                node_id=e.get("node_id"),
                branch_id=e.get("branch_id"),
                attempt=attempt if isinstance(attempt, int) else None,
                emitted_at=at,
                recorded_at=e.get("recorded_at"),
                effect=e.get("effect") or "",
                seq=e.get("checkpoint_seq"),
                took_ms=took,
            )
        )
    return out


def took(ms: float | None) -> str:
    """A duration to read: ``840 ms``, ``2.4 s``, ``3 min 05 s``; empty for none."""
    if ms is None:
        return ""
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    minutes, seconds = divmod(round(ms / 1000), 60)
    return f"{minutes} min {seconds:02d} s"


def page_of(total: int, start: int, size: int) -> tuple[int, int | None, int | None]:
    """A page of ``size`` items from ``start`` (0-based, clamped to what exists): the
    start, and the starts of the previous and next pages (None at either end)."""
    start = min(max(start, 0), max(total - 1, 0)) // size * size
    previous = max(start - size, 0) if start > 0 else None
    following = start + size if start + size < total else None
    return start, previous, following
