"""A run's time to scale (alma_core.ui.gantt): a row per node of each lane, each attempt
a bar from its start to its end, a running node up to now, and the axis's marks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from alma_core.ui import gantt

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def ev(type_: str, node: str, at_s: float, branch: str | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "type": type_,
        "node_id": node,
        "branch_id": branch,
        "emitted_at": T0 + timedelta(seconds=at_s),
        **kw,
    }


def test_attempts_are_bars_of_one_row_and_a_running_node_reaches_now() -> None:
    events = [
        ev("node.started", "plan", 0),
        ev("node.completed", "plan", 2),
        ev("node.started", "fetch", 3, "A", attempt=1),
        ev("node.failed", "fetch", 4, "A", attempt=1),
        ev("node.started", "fetch", 5, "A", attempt=2),
        ev("node.completed", "fetch", 7, "A", attempt=2),
        ev("node.started", "write", 8),  # still running
    ]
    g = gantt.build(events, now=T0 + timedelta(seconds=10))
    assert [(r.lane, r.node_id) for r in g.rows] == [
        ("main", "plan"),
        ("main", "write"),
        ("A", "fetch"),
    ]
    fetch = g.rows[2]
    assert [(b.outcome, b.attempt, b.seconds) for b in fetch.bars] == [
        ("failed", 1, 1.0),
        ("succeeded", 2, 2.0),
    ]
    write = g.rows[1].bars[0]
    assert (write.outcome, write.end) == ("running", None)
    # to scale: 10 s over the plot's width, the gap between the attempts visible
    per_s = gantt.PLOT_W / 10
    left = gantt.PAD + gantt.LABEL_W
    assert [b.x for b in fetch.bars] == [left + 3 * per_s, left + 5 * per_s]
    assert [b.width for b in fetch.bars] == [per_s, 2 * per_s]
    assert write.x + write.width == left + gantt.PLOT_W  # up to now
    assert [r.y for r in g.rows] == [gantt.TOP + i * gantt.ROW_H for i in range(3)]
    assert [label for _, label in g.ticks] == ["0 s", "2 s", "4 s", "6 s", "8 s", "10 s"]


def test_an_end_without_a_start_is_a_moment_and_a_second_start_cuts_the_first() -> None:
    events = [
        ev("node.completed", "quick", 1),
        ev("node.started", "flaky", 2),
        ev("node.started", "flaky", 3),  # its first attempt never said how it ended
        ev("node.completed", "flaky", 3.5),
    ]
    g = gantt.build(events, now=T0 + timedelta(seconds=4))
    quick, flaky = g.rows
    assert [(b.outcome, b.seconds) for b in quick.bars] == [("succeeded", 0.0)]
    assert quick.bars[0].width == 2.0  # drawn, however short
    assert [(b.outcome, b.seconds) for b in flaky.bars] == [("unended", 1.0), ("succeeded", 0.5)]
    assert [label for _, label in g.ticks][:4] == ["0 ms", "500 ms", "1 s", "1.5 s"]


def test_no_node_events_no_rows() -> None:
    g = gantt.build([{"type": "workflow.completed", "node_id": None, "emitted_at": T0}], now=T0)
    assert (g.rows, g.start, g.ticks) == ([], None, [])


def test_a_long_run_draws_its_first_rows_and_says_how_many_more() -> None:
    events = [ev("node.completed", f"n{i}", i) for i in range(gantt.DRAWN + 7)]
    g = gantt.build(events, now=T0)
    assert (len(g.rows), g.left_out) == (gantt.DRAWN, 7)
    assert g.end == T0 + timedelta(seconds=gantt.DRAWN - 1)  # the scale of what is drawn


def test_a_run_of_many_attempts_draws_the_first_and_counts_the_rest() -> None:
    events = [ev("node.completed", f"n{i % 3}", i) for i in range(gantt.BARS + 50)]
    g = gantt.build(events, now=T0)
    assert sum(len(r.bars) for r in g.rows) == gantt.BARS
    assert g.bars_left_out == 50
    assert max(b.start for r in g.rows for b in r.bars) == T0 + timedelta(seconds=gantt.BARS - 1)
