"""The run inspector's graph of a run (alma_core.ui.graph): the nodes a run's events
reached, the edges between them, each node's outcome, and a layout in which no two
boxes meet."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from alma_core.ui import graph

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


class Run:
    """Events as ``runs.report`` gives them, in the order the run recorded them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []

    def ev(self, type_: str, node: str | None, branch: str | None = None) -> dict[str, Any]:
        e = {
            "event_id": f"e{len(self.events)}",
            "type": type_,
            "node_id": node,
            "branch_id": branch,
            "emitted_at": T0 + timedelta(seconds=len(self.events)),
            "checkpoint_seq": None,
        }
        self.events.append(e)
        return e

    def checkpoint(self, e: dict[str, Any], kind: str, **kw: Any) -> int:
        seq = len(self.checkpoints) + 1
        e["checkpoint_seq"] = seq
        self.checkpoints.append({"seq": seq, "kind": kind, **kw})
        return seq

    def node(self, node: str, branch: str | None = None, *, fails: int = 0) -> int:
        for _ in range(fails):
            self.ev("node.started", node, branch)
            self.checkpoint(self.ev("node.failed", node, branch), "failure", node_id=node)
        self.ev("node.started", node, branch)
        return self.checkpoint(self.ev("node.completed", node, branch), "node", node_id=node)

    def merge(self, node: str, *seqs: int) -> int:
        """The joiner's merge: the join's event itself names no checkpoint (handed off);
        the merge checkpoint carries the event's id."""
        e = self.ev("branch.join", node)
        seq = self.checkpoint(e, "merge", node_id=node, merged_from=list(seqs))
        self.checkpoints[-1]["event_id"] = e["event_id"]
        e["checkpoint_seq"] = None
        return seq


def shape(g: graph.Graph) -> dict[str, tuple[str, str, int, int]]:
    return {f"{n.lane}/{n.node_id}": (n.kind, n.note, n.column, n.rank) for n in g.nodes}


def edges(g: graph.Graph) -> set[str]:
    return {f"{a[1]}->{b[1]}" for a, b in ((e.source, e.target) for e in g.edges)}


def test_a_fan_out_and_in_is_drawn_side_by_side_with_retries_and_the_end() -> None:
    run = Run()
    run.node("plan")
    x = run.node("search", "x", fails=2)
    y = run.node("read", "y")
    run.merge("gather", x, y)
    run.node("draft")
    run.ev("workflow.completed", None)
    g = graph.build(run.events, run.checkpoints, "succeeded")
    assert g.lanes == ["main", "x", "y"]
    assert shape(g) == {
        "main/plan": ("node", "succeeded", 0, 0),
        "x/search": ("node", "succeeded after 2 failed", 1, 1),
        "y/read": ("node", "succeeded", 2, 1),  # beside x: they ran side by side
        "main/gather": ("merge", "merge", 0, 2),
        "main/draft": ("node", "succeeded", 0, 3),
        "main/(end)": ("end", "run succeeded", 0, 4),
    }
    assert edges(g) == {
        "plan->search",
        "plan->read",
        "plan->gather",
        "search->gather",
        "read->gather",
        "gather->draft",
        "draft->(end)",
    }
    # each box links to its latest checkpoint; every edge runs downwards here
    assert {n.node_id: n.seq for n in g.nodes}["search"] == x
    assert all(e.path.startswith("M") for e in g.edges)


def test_a_started_node_without_its_end_is_running_since_its_start() -> None:
    run = Run()
    run.node("plan")
    started = run.ev("node.started", "write")
    g = graph.build(run.events, run.checkpoints)
    write = next(n for n in g.nodes if n.node_id == "write")
    assert (write.status, write.since, write.seq) == ("running", started["emitted_at"], None)
    failed = Run()
    failed.ev("node.started", "call")
    failed.checkpoint(failed.ev("node.failed", "call"), "failure", node_id="call")
    assert [n.note for n in graph.build(failed.events, failed.checkpoints).nodes] == ["failed"]


def test_overlapping_nodes_of_one_lane_are_a_sequence_and_a_real_loop_goes_back() -> None:
    run = Run()
    run.ev("node.started", "a")
    run.ev("node.started", "b")  # a and b overlap on the main line
    run.ev("node.completed", "a")
    run.ev("node.completed", "b")
    assert edges(graph.build(run.events, [])) == {"a->b"}  # no b->a
    loop = Run()
    for node in ("a", "b", "a"):
        loop.node(node)
    g = graph.build(loop.events, loop.checkpoints)
    assert edges(g) == {"a->b", "b->a"}
    back = next(e for e in g.edges if e.source[1] == "b")
    assert back.path.startswith(f"M{graph.PAD + graph.BOX_W},")  # from b's side, around


def test_fifty_nodes_in_twenty_branches_never_share_a_place() -> None:
    run = Run()
    run.node("start")
    heads = []
    for b in range(20):
        for step in range(2 if b < 10 else 3):
            seq = run.node(f"b{b}-step{step}", f"branch-{b}")
        heads.append(seq)
    run.merge("join", *heads)
    g = graph.build(run.events, run.checkpoints)
    assert len(g.nodes) == 52
    places = [(n.column, n.rank) for n in g.nodes]
    assert len(set(places)) == len(places)
    assert (g.width, g.height) == (
        2 * graph.PAD + 21 * graph.COLUMN_W - (graph.COLUMN_W - graph.BOX_W),
        2 * graph.PAD + graph.HEADER + 5 * graph.ROW_H - (graph.ROW_H - graph.BOX_H),
    )
    join = next(n for n in g.nodes if n.node_id == "join")
    assert join.rank == 4  # one below the longest branch
    assert sum(1 for e in g.edges if e.target == ("main", "join")) == 21  # 20 heads, start


def test_a_long_run_draws_its_first_nodes_and_says_how_many_more() -> None:
    run = Run()
    for i in range(graph.DRAWN + 30):
        run.node(f"n{i}", "side" if i == graph.DRAWN + 5 else None)
    g = graph.build(run.events, run.checkpoints)
    assert (len(g.nodes), g.left_out) == (graph.DRAWN, 30)
    assert g.nodes[-1].node_id == f"n{graph.DRAWN - 1}"
    assert g.lanes == ["main"]  # the branch reached past the drawn ones has no column
    assert len(g.edges) == graph.DRAWN - 1  # only between drawn nodes


def test_a_merge_shows_the_reducers_its_join_named() -> None:
    run = Run()
    x, y = run.node("a", "x"), run.node("b", "y")
    run.merge("gather", x, y)
    run.events[-1]["reducers"] = {"items": "append", "total": "sum"}
    run.events[-1]["default_reducer"] = "last_write_wins"
    run.merge("again", x, y)  # a join that named none: the workflow's registered ones
    g = graph.build(run.events, run.checkpoints)
    gather = next(n for n in g.nodes if n.node_id == "gather")
    assert gather.note == "merge: items: append, total: sum, others: last_write_wins"
    assert gather.note_shown == gather.note[: graph.NOTE_CHARS - 1] + "…"  # its box's room
    assert next(n for n in g.nodes if n.node_id == "again").note == "merge"


def test_nodes_other_runs_reach_are_drawn_apart_as_never_reached() -> None:
    run = Run()
    run.node("plan")
    run.node("search", "x")
    elsewhere = {"plan": 20, "search": 20, "review": 18, "publish": 15, "fix": 2}
    for outcome, said in (("failed", "never reached"), ("running", "not reached yet")):
        g = graph.build(run.events, run.checkpoints, outcome, elsewhere, 20)
        below = [n for n in g.nodes if n.kind == "unreached"]
        # the most often reached first, in a row of their own under the run's nodes
        assert [n.node_id for n in below] == ["review", "publish", "fix"]
        assert below[0].note == f"{said}; 18/20 do"
        assert below[0].detail == f"{said} by this run; 18 of the workflow's 20 latest " + (
            "finished runs reach it"
        )
        assert {n.rank for n in below} == {2}
        assert [n.column for n in below] == [0, 1, 2]
        [alone] = [
            n
            for n in graph.build(run.events, run.checkpoints, outcome, {"fix": 1}, 1).nodes
            if n.kind == "unreached"
        ]
        assert alone.detail == f"{said} by this run; the workflow's latest finished run reaches it"
        assert g.width >= below[-1].x + graph.BOX_W  # the drawing holds them
        assert not {e.target for e in g.edges} & {(n.lane, n.node_id) for n in below}
    # a node reached in a branch is reached, whatever lane other runs had it in
    assert "search" not in {n.node_id for n in g.nodes if n.kind == "unreached"}
    # none elsewhere, or nothing missing: nothing apart
    assert all(n.kind != "unreached" for n in graph.build(run.events, run.checkpoints).nodes)
    drawn = graph.build(run.events, run.checkpoints, "succeeded", {"plan": 3}, 3)
    assert all(n.kind != "unreached" for n in drawn.nodes)
