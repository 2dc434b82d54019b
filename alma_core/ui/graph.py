"""A run drawn as the graph it took: its nodes, the edges between them that its events
show (each lane in order, a branch from where the main line was when it began, each
merge from the branch heads it folded, the end), each node coloured by its outcome.
Pure: from a run's events and checkpoints to boxes and lines with their coordinates,
which ``run.html`` draws as SVG (no script). Unit-tested (tests/unit/test_ui_graph.py).

Layout: one column per lane (the main line first, then the branches as they began),
one row per rank (a node's rank is one more than the highest of the nodes it came
from), so branches that run side by side are drawn side by side. A run of 50 nodes and
20 branches is 20 columns wide: the drawing scrolls within its box.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

from alma_core.ui.views import MAIN_LANE as MAIN  # as the timeline names it

END = "(end)"
COLUMN_W, BOX_W, BOX_H, ROW_H, PAD = 180, 156, 40, 64, 12
HEADER = 22  # the lanes' names above their columns
LABEL_CHARS = 20  # of a node's id in its box; the whole id is its tooltip
NOTE_CHARS = 26  # of its note, in smaller letters
DRAWN = 120  # nodes drawn at most: nothing on a page grows with a run
UNREACHED_COLUMNS = 4  # the nodes never reached, in rows of at least this many


@dataclass
class GraphNode:
    """A node of the run in one lane: what became of it, and where it is drawn."""

    lane: str
    node_id: str
    kind: str = "node"  # node, merge, end or unreached (other runs reach it, not this one)
    status: str = "running"  # succeeded, failed, retried, running; merge; end: the outcome
    attempts: int = 0  # node.completed and node.failed events
    failures: int = 0
    seq: int | None = None  # its latest checkpoint (the box links to it)
    since: datetime | None = None  # running: its latest node.started
    rank: int = 0
    column: int = 0
    reducers: dict[str, str] | None = None  # merge: the join's reducer per field, as sent
    default_reducer: str | None = None  # merge: for the fields it does not name
    reached_by: tuple[int, int] | None = None  # unreached: (of how many other runs, of n)

    @property
    def label(self) -> str:
        text = self.node_id
        return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"

    @property
    def note(self) -> str:
        """The box's second line: what became of the node."""
        if self.kind == "merge":
            return "merge: " + self.reducing if self.reducers or self.default_reducer else "merge"
        if self.kind == "unreached" and self.reached_by is not None:
            return f"{self.status}; {self.reached_by[0]}/{self.reached_by[1]} do"
        if self.kind == "end":
            return f"run {self.status}"
        if self.status == "running":
            return "running"
        if self.status == "retried":
            return f"succeeded after {self.failures} failed"
        if self.status == "failed" and self.attempts > 1:
            return f"failed {self.failures} of {self.attempts}"
        return self.status

    @property
    def detail(self) -> str:
        """What the box's tooltip says of the node (its note, in words for the nodes
        never reached)."""
        if self.kind == "unreached" and self.reached_by is not None:
            n, of = self.reached_by
            if of == 1:
                return f"{self.status} by this run; the workflow's latest finished run reaches it"
            return (
                f"{self.status} by this run; {n} of the workflow's {of} latest finished "
                "runs reach it"
            )
        return self.note

    @property
    def note_shown(self) -> str:
        """The note as its box has room for it (the whole one is the box's tooltip)."""
        text = self.note
        return text if len(text) <= NOTE_CHARS else text[: NOTE_CHARS - 1] + "…"

    @property
    def reducing(self) -> str:
        """A merge's reducers as its join named them (field: reducer, then the default
        for the rest); empty: the workflow's registered ones, or the default."""
        named = [f"{f}: {r}" for f, r in (self.reducers or {}).items()]
        rest = [f"others: {self.default_reducer}"] if self.default_reducer else []
        return ", ".join(named + rest)

    @property
    def x(self) -> int:
        return PAD + self.column * COLUMN_W

    @property
    def y(self) -> int:
        return PAD + HEADER + self.rank * ROW_H


@dataclass(frozen=True)
class Edge:
    source: tuple[str, str]
    target: tuple[str, str]
    path: str  # the SVG path's d


@dataclass
class Graph:
    lanes: list[str]
    nodes: list[GraphNode]
    edges: list[Edge] = field(default_factory=list)
    left_out: int = 0  # nodes past DRAWN, in the order the run reached them
    columns: int = 0  # drawn: the lanes', or more for the nodes never reached
    box_w: ClassVar[int] = BOX_W  # every node's box, as the template draws it
    box_h: ClassVar[int] = BOX_H

    @property
    def width(self) -> int:
        return 2 * PAD + max(1, len(self.lanes), self.columns) * COLUMN_W - (COLUMN_W - BOX_W)

    @property
    def height(self) -> int:
        ranks = max((n.rank for n in self.nodes), default=0) + 1
        return 2 * PAD + HEADER + ranks * ROW_H - (ROW_H - BOX_H)

    def lane_x(self, index: int) -> int:
        """Where the ``index``th lane's name is written (its column's middle)."""
        return PAD + index * COLUMN_W + BOX_W // 2


def build(
    events: Iterable[Mapping[str, Any]],
    checkpoints: Iterable[Mapping[str, Any]],
    outcome: str | None = None,
    elsewhere: Mapping[str, int] | None = None,
    others: int = 0,
) -> Graph:
    """The run's graph from its events (in the order the run recorded them), its
    checkpoints (for what each merge folded) and, for its end, the run's status.
    ``elsewhere``: the nodes ``others`` other runs of the workflow reached, with how
    many of them did; those this run did not reach are drawn below it, apart, as
    never reached (not reached yet while it runs), most often reached first.

    A node is entered by its ``node.started``, or by its end (``node.completed``,
    ``node.failed``) when it was not running: only an entry draws an edge, from the node
    its lane reached last (a branch's first node: from where the main line was), so two
    nodes of one lane that overlap are drawn one after the other, never as a loop, and a
    retry is its node again, with no edge."""
    by_seq = {cp["seq"]: cp for cp in checkpoints}
    # a join's event is handed to the joiner: its merge is found by the event's id
    merges = {cp["event_id"]: cp for cp in by_seq.values() if cp["kind"] == "merge"}
    drawn: set[int] = set()
    lanes: dict[str, int] = {MAIN: 0}
    nodes: dict[tuple[str, str], GraphNode] = {}
    edges: dict[tuple[tuple[str, str], tuple[str, str]], None] = {}
    last: dict[str, tuple[str, str]] = {}  # each lane's node reached last
    at_seq: dict[int, tuple[str, str]] = {}  # the node each checkpoint belongs to

    beyond: set[tuple[str, str]] = set()  # reached after DRAWN others: counted, not built

    def reach(
        key: tuple[str, str], froms: list[tuple[str, str]], kind: str = "node"
    ) -> GraphNode | None:
        lane = key[0]
        node = nodes.get(key)
        if node is None and len(nodes) >= DRAWN:
            beyond.add(key)
            return None
        column = lanes.setdefault(lane, len(lanes))
        if node is None:
            rank = max((nodes[f].rank + 1 for f in froms if f in nodes), default=0)
            node = nodes[key] = GraphNode(lane, key[1], kind=kind, rank=rank, column=column)
        for f in froms:
            if f != key:
                edges.setdefault((f, key), None)
        last[lane] = key
        return node

    def came_from(lane: str) -> list[tuple[str, str]]:
        """Where a node of ``lane`` comes from: the lane's last node, or for a branch's
        first node, where the main line was."""
        if lane in last:
            return [last[lane]]
        return [last[MAIN]] if lane != MAIN and MAIN in last else []

    def merge(cp: Mapping[str, Any], join: Mapping[str, Any] | None = None) -> None:
        seq = cp["seq"]
        folded = [at_seq[s] for s in cp.get("merged_from") or [] if s in at_seq]
        key = (MAIN, cp.get("node_id") or f"merge #{seq}")
        node = reach(key, list(dict.fromkeys([*came_from(MAIN), *folded])), kind="merge")
        if node is not None:
            node.status, node.seq = "merge", seq
            at_seq[seq] = key
            if join is not None:
                node.reducers = dict(join.get("reducers") or {}) or None
                node.default_reducer = join.get("default_reducer")

    for e in events:
        kind = e["type"]
        seq = e.get("checkpoint_seq")
        if kind in ("node.started", "node.completed", "node.failed"):
            lane = e.get("branch_id") or MAIN
            key = (lane, e.get("node_id") or "?")
            entered = kind == "node.started" or key not in nodes or nodes[key].status != "running"
            found = (
                reach(key, came_from(lane) if last.get(lane) != key else [])
                if entered
                else nodes[key]
            )
            if found is None:
                continue
            node = found
            if kind == "node.started":
                node.status, node.since = "running", e.get("emitted_at")
            else:
                node.attempts += 1
                failed = kind == "node.failed"
                node.failures += failed
                node.since = None
                if failed:
                    node.status = "failed"
                else:
                    node.status = "retried" if node.failures else "succeeded"
            if seq is not None:
                node.seq = seq
                at_seq[seq] = key
        elif kind == "branch.join":
            cp = by_seq.get(seq) if seq is not None else merges.get(e.get("event_id"))
            if cp is not None and cp["kind"] == "merge":
                merge(cp, e)
                drawn.add(cp["seq"])
        elif kind == "workflow.completed":
            end = reach((MAIN, END), came_from(MAIN), kind="end")
            if end is not None:
                end.status = outcome or "completed"
    for seq in sorted({cp["seq"] for cp in merges.values()} - drawn):
        merge(by_seq[seq])  # a merge no event of the run names (a join recorded elsewhere)
    graph = Graph(list(lanes), list(nodes.values()), left_out=len(beyond))
    graph.edges = [Edge(a, b, _path(nodes[a], nodes[b])) for a, b in edges]
    reached = {key[1] for key in nodes} | {key[1] for key in beyond}
    missing = sorted(
        ((n, node) for node, n in (elsewhere or {}).items() if node not in reached),
        key=lambda m: (-m[0], m[1]),
    )
    below = max((n.rank for n in graph.nodes), default=-1) + 1
    width = max(len(lanes), UNREACHED_COLUMNS)
    for i, (n, node_id) in enumerate(missing):
        if len(graph.nodes) >= DRAWN:
            graph.left_out += len(missing) - i
            break
        graph.nodes.append(
            GraphNode(
                MAIN,
                node_id,
                kind="unreached",
                status="not reached yet"
                if outcome in (None, "running", "blocked")
                else "never reached",
                rank=below + i // width,
                column=i % width,
                reached_by=(n, others),
            )
        )
    graph.columns = max(len(lanes), min(len(missing), width))
    return graph


def _path(a: GraphNode, b: GraphNode) -> str:
    """From the bottom of ``a``'s box to the top of ``b``'s; back up (a loop), from
    ``a``'s side around to ``b``'s."""
    ax, bx = a.x + BOX_W // 2, b.x + BOX_W // 2
    if b.rank > a.rank:
        ay, by = a.y + BOX_H, b.y
        mid = (ay + by) // 2
        return f"M{ax},{ay} C{ax},{mid} {bx},{mid} {bx},{by}"
    side_a, side_b = a.x + BOX_W, b.x + BOX_W
    out = max(side_a, side_b) + 14
    return (
        f"M{side_a},{a.y + BOX_H // 2} C{out},{a.y + BOX_H // 2} "
        f"{out},{b.y + BOX_H // 2} {side_b},{b.y + BOX_H // 2}"
    )
