"""Two runs compared (alma_core.ui.compare): their paths side by side and the first step
where they part, a fork aligned with its source from the moment it was taken."""

from __future__ import annotations

from typing import Any

from alma_core.ui import compare


def cps(*steps: tuple[str, str] | tuple[str, str, str]) -> list[dict[str, Any]]:
    """Checkpoints in seq order from (node, state hash[, kind])."""
    out = []
    for seq, step in enumerate(steps, start=1):
        node, digest = step[0], step[1]
        kind = step[2] if len(step) > 2 else "node"
        out.append(
            {"seq": seq, "node_id": node, "branch_id": None, "kind": kind, "state_hash": digest}
        )
    return out


def test_two_runs_part_at_the_first_other_node() -> None:
    yesterday = cps(("plan", "h1"), ("search", "h2"), ("draft", "h3"), ("review", "h4"))
    today = cps(("plan", "h1"), ("search", "h2"), ("call", "x3", "failure"))
    c = compare.compare(yesterday, today)
    assert c.parted == 2
    assert c.why == "A ran draft (main, node) where B ran call (main, failure)"
    assert c.seqs == (3, 3)
    assert [r.same for r in c.rows] == [True, True, False, False]
    assert c.rows[3].b is None  # A went on alone


def test_the_same_node_with_another_state_is_where_they_part() -> None:
    c = compare.compare(cps(("plan", "h1"), ("draft", "h2")), cps(("plan", "h1"), ("draft", "zz")))
    assert (c.parted, c.why) == (1, "both ran draft (main), to different states")


def test_one_run_stopping_where_the_other_went_on_and_the_same_path() -> None:
    c = compare.compare(cps(("plan", "h1")), cps(("plan", "h1"), ("draft", "h2")))
    assert (c.parted, c.why, c.seqs) == (1, "A stopped where B went on to draft (main)", (1, 2))
    same = compare.compare(cps(("plan", "h1")), cps(("plan", "h1")))
    assert (same.parted, same.seqs) == (None, (None, None))
    assert same.why.startswith("the same path")


def test_a_fork_is_aligned_with_its_source_from_the_moment_taken() -> None:
    source = cps(("plan", "h1"), ("search", "h2"), ("draft", "h3"), ("review", "h4"))
    # forked at seq 2: its first checkpoint holds the source's state then (h2)
    fork = cps(("fork", "h2"), ("draft", "h3"), ("review", "other"))
    c = compare.compare(source, fork, b_forked_at=2)
    assert c.aligned_at == (2, 1)
    assert [(r.a.seq if r.a else None, r.b.seq if r.b else None) for r in c.rows] == [
        (1, None),  # the source's history before the fork: shared
        (2, 1),  # the moment taken beside the fork's first state
        (3, 2),
        (4, 3),
    ]
    assert (c.parted, c.seqs) == (3, (4, 3))
    assert c.why == "both ran review (main), to different states"
    edited = cps(("fork", "edited"), ("draft", "h3"))
    c = compare.compare(source, edited, b_forked_at=2)
    assert (c.parted, c.seqs) == (1, (2, 1))  # the edit itself
    assert c.why == "B began from A's seq 2 with another state (the fork was edited)"
