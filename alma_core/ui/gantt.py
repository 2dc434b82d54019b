"""A run's time, drawn to scale: one row per node of each lane (the main line first,
then the branches as they began), each attempt a bar from its ``node.started`` to its
end (``node.completed`` green, ``node.failed`` red), a node still running a bar up to
now, so retries are segments of one row and the gaps between nodes show. Times are the
publisher's clock (``emitted_at``), as the run's history gives them. Pure: from a run's
events to bars with their coordinates, drawn as SVG by ``run.html``. Unit-tested
(tests/unit/test_ui_gantt.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, ClassVar

from alma_core.ui.views import MAIN_LANE as MAIN  # as the timeline names it

LABEL_W, PLOT_W, ROW_H, BAR_H, TOP, PAD = 220, 760, 22, 14, 28, 8
TICKS = 6  # about this many time marks along the top
DRAWN = 120  # rows drawn at most: nothing on a page grows with a run
BARS = 150  # attempts drawn at most, the first the run made; the rest are counted


@dataclass(frozen=True)
class Bar:
    """One attempt of a node: when it began and ended (None: running), how it ended."""

    start: datetime
    end: datetime | None
    outcome: str  # succeeded, failed, running; unended: started again before it ended
    attempt: int | None
    x: float = 0.0
    width: float = 0.0

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else (self.end - self.start).total_seconds()


@dataclass
class Row:
    lane: str
    node_id: str
    bars: list[Bar] = field(default_factory=list)
    y: int = 0


@dataclass
class Gantt:
    rows: list[Row]
    start: datetime | None
    end: datetime | None
    ticks: list[tuple[float, str]] = field(default_factory=list)  # (x, label)
    left_out: int = 0  # rows past DRAWN
    bars_left_out: int = 0  # attempts past BARS
    label_w: ClassVar[int] = LABEL_W
    bar_h: ClassVar[int] = BAR_H

    @property
    def width(self) -> int:
        return LABEL_W + PLOT_W + 2 * PAD

    @property
    def height(self) -> int:
        return TOP + max(1, len(self.rows)) * ROW_H + PAD


def build(events: Iterable[Mapping[str, Any]], now: datetime) -> Gantt:
    """The run's bars from its events (in the order the run recorded them); ``now`` ends
    the bar of a node still running."""
    rows: dict[tuple[str, str], Row] = {}
    lanes: dict[str, int] = {MAIN: 0}
    open_: dict[tuple[str, str], tuple[datetime, int | None]] = {}
    beyond: set[tuple[str, str]] = set()
    made = bars_left_out = 0  # attempts drawn; those past the first BARS: counted only

    def add(row: Row, bar: Bar) -> None:
        nonlocal made, bars_left_out
        if made >= BARS:
            bars_left_out += 1
            return
        made += 1
        row.bars.append(bar)

    for e in events:
        kind, at = e["type"], e.get("emitted_at")
        if kind not in ("node.started", "node.completed", "node.failed") or at is None:
            continue
        lane = e.get("branch_id") or MAIN
        key = (lane, e.get("node_id") or "?")
        row = rows.get(key)
        if row is None:
            if len(rows) >= DRAWN:  # past the first DRAWN nodes the run reached: counted
                beyond.add(key)
                continue
            lanes.setdefault(lane, len(lanes))
            row = rows[key] = Row(lane, key[1])
        attempt = e.get("attempt") if isinstance(e.get("attempt"), int) else None
        if kind == "node.started":
            if key in open_:  # started again with no end: the earlier attempt is cut here
                began, tried = open_.pop(key)
                add(row, Bar(began, at, "unended", tried))
            open_[key] = (at, attempt)
            continue
        outcome = "succeeded" if kind == "node.completed" else "failed"
        if key in open_:
            began, tried = open_.pop(key)
            add(row, Bar(began, at, outcome, attempt if attempt is not None else tried))
        else:
            add(row, Bar(at, at, outcome, attempt))  # no start: a moment
    for key, (began, tried) in open_.items():
        add(rows[key], Bar(began, None, "running", tried))
    ordered = sorted(rows.values(), key=lambda r: lanes[r.lane])  # stable: first seen first
    left_out = len(beyond)
    times = [t for r in ordered for b in r.bars for t in (b.start, b.end or now)]
    if not times:
        return Gantt([], None, None)
    start, end = min(times), max(times)
    span = max((end - start).total_seconds(), 0.001)
    scale = PLOT_W / span

    def x_of(t: datetime) -> float:
        return round(PAD + LABEL_W + (t - start).total_seconds() * scale, 1)

    for i, row in enumerate(ordered):
        row.y = TOP + i * ROW_H
        row.bars = [
            replace(
                b, x=x_of(b.start), width=max(2.0, round(x_of(b.end or now) - x_of(b.start), 1))
            )
            for b in row.bars
        ]
    step = _tick(span)
    ticks = []
    t = 0.0
    while t <= span + 1e-9:
        ticks.append((round(PAD + LABEL_W + t * scale, 1), _label(t, step)))
        t += step
    return Gantt(ordered, start, end, ticks, left_out, bars_left_out)


def _tick(span: float) -> float:
    """A round step (in seconds) that marks ``span`` about :data:`TICKS` times."""
    for step in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30,
                 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400):  # fmt: skip
        if span / step <= TICKS:
            return float(step)
    return span / TICKS


def _label(t: float, step: float) -> str:
    if step < 1:
        return f"{t * 1000:.0f} ms" if t < 1 - 1e-9 else f"{round(t, 3):g} s"
    if step < 60:
        return f"{t:.0f} s"
    if step < 3600:
        return f"{t / 60:.0f} min"
    return f"{t / 3600:.0f} h"
