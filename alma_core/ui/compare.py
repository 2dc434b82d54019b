"""Two runs side by side: their paths (each checkpoint in seq order: its lane, node and
kind) aligned step by step, and the first step where they part: another node, another
kind, or the same node with another state (state hashes differ). A fork is aligned with
its source from the moment it was taken (its first checkpoint beside the source's
checkpoint at that seq), so "where did the retry go another way" is its first
difference. Pure: from two runs' checkpoints (without their states) to rows; the page
then reads the two states at the parting and diffs them (``history.diff``).
Unit-tested (tests/unit/test_ui_compare.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from alma_core.ui.views import MAIN_LANE as MAIN  # as the timeline names it


@dataclass(frozen=True)
class Step:
    seq: int
    lane: str
    node_id: str
    kind: str
    state_hash: str

    @property
    def what(self) -> tuple[str, str, str]:
        return (self.lane, self.node_id, self.kind)


@dataclass(frozen=True)
class Row:
    """One step of each run, side by side (None: that run has no such step)."""

    a: Step | None
    b: Step | None
    same: bool  # same lane, node and kind, and the same state


@dataclass(frozen=True)
class Comparison:
    rows: list[Row]
    parted: int | None  # the index of the first row that differs; None: the same path
    why: str  # in words
    aligned_at: tuple[int, int] | None = None  # a fork: (the source's seq, the fork's seq)

    @property
    def seqs(self) -> tuple[int | None, int | None]:
        """The two checkpoints whose states the page diffs: at the parting, each run's
        step there (a run that had stopped: its last step before)."""
        if self.parted is None:
            return (None, None)
        row = self.rows[self.parted]
        before = self.rows[: self.parted]
        a = row.a or next((r.a for r in reversed(before) if r.a), None)
        b = row.b or next((r.b for r in reversed(before) if r.b), None)
        return (a.seq if a else None, b.seq if b else None)


def steps(checkpoints: Sequence[Mapping[str, Any]]) -> list[Step]:
    return [
        Step(
            int(cp["seq"]),
            cp.get("branch_id") or MAIN,
            cp.get("node_id") or "",
            str(cp["kind"]),
            str(cp.get("state_hash") or ""),
        )
        for cp in checkpoints
    ]


def compare(
    a: Sequence[Mapping[str, Any]],
    b: Sequence[Mapping[str, Any]],
    *,
    b_forked_at: int | None = None,
) -> Comparison:
    """Run A's checkpoints beside run B's (each in seq order). ``b_forked_at``: B is a
    fork of A taken at A's checkpoint of that seq, so A's earlier steps stand alone and
    B's first step (the fork's) stands beside it."""
    left, right = steps(a), steps(b)
    rows: list[Row] = []
    aligned_at = None
    aligned_row: int | None = None
    if b_forked_at is not None and right:
        shared = [s for s in left if s.seq < b_forked_at]
        rows += [Row(s, None, True) for s in shared]
        left = left[len(shared) :]
        if left:
            aligned_at, aligned_row = (left[0].seq, right[0].seq), len(rows)
            first_same = left[0].state_hash == right[0].state_hash
            rows.append(Row(left[0], right[0], first_same))  # the moment taken, edited or not
            left, right = left[1:], right[1:]
    for i in range(max(len(left), len(right))):
        x = left[i] if i < len(left) else None
        y = right[i] if i < len(right) else None
        same = x is not None and y is not None and x.what == y.what and x.state_hash == y.state_hash
        rows.append(Row(x, y, same))
    parted = next((i for i, r in enumerate(rows) if not r.same), None)
    why = _why(rows, parted)
    if parted is not None and parted == aligned_row and aligned_at is not None:
        why = f"B began from A's seq {aligned_at[0]} with another state (the fork was edited)"
    return Comparison(rows, parted, why, aligned_at)


def _why(rows: list[Row], parted: int | None) -> str:
    if parted is None:
        return "the same path: every step the same node with the same state"
    row = rows[parted]
    if row.a is None or row.b is None:
        went, stopped = ("B", "A") if row.a is None else ("A", "B")
        ran = row.b if row.a is None else row.a
        assert ran is not None
        return f"{stopped} stopped where {went} went on to {ran.node_id or ran.kind} ({ran.lane})"
    if row.a.what != row.b.what:
        return (
            f"A ran {row.a.node_id or row.a.kind} ({row.a.lane}, {row.a.kind}) where B ran "
            f"{row.b.node_id or row.b.kind} ({row.b.lane}, {row.b.kind})"
        )
    return f"both ran {row.a.node_id or row.a.kind} ({row.a.lane}), to different states"
