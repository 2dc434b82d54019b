"""The cluster checker's judgement of joins (tests/cluster/checker.py), on rows made by
hand: each way a join can go wrong is named, and a reply sent again is counted, not
taken for a fault."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from tests.cluster.checker import Verdict, judge_joins


def node(seq: int, branch: str, step: int) -> dict[str, Any]:
    return {
        "seq": seq,
        "kind": "node",
        "branch_id": branch,
        "state": json.dumps({"history": [step]}),
    }


def merge(seq: int, rounds: int) -> dict[str, Any]:
    history = list(range(2 * rounds))
    return {
        "seq": seq,
        "kind": "merge",
        "branch_id": None,
        "state": json.dumps({"history": history}),
    }


def one_round(run: str = "r") -> tuple[list[dict[str, Any]], dict[str, list[Any]], list[Any]]:
    joined = [{"run": run, "join_id": "j0", "round": 0, "requests": 1, "seq": 3}]
    runs = {run: [node(1, "a", 0), node(2, "b", 1), merge(3, 1)]}
    rows = [{"run_id": run, "join_id": "j0", "status": "ok", "checkpoint_seq": 3}]
    return joined, runs, rows


def judged(joined: Any, runs: Any, rows: Any, replies: Counter[tuple[str, str]]) -> Verdict:
    verdict = Verdict()
    judge_joins(verdict, joined, runs, rows, replies)
    return verdict


def test_a_join_merged_once_and_answered_once_is_ok() -> None:
    verdict = judged(*one_round(), Counter({("r", "j0"): 1}))
    assert (verdict.problems, verdict.joins, verdict.replies_repeated) == ([], 1, 0)


def test_a_reply_beyond_the_requests_is_counted_not_a_fault() -> None:
    verdict = judged(*one_round(), Counter({("r", "j0"): 2}))
    assert (verdict.problems, verdict.replies_repeated) == ([], 1)
    joined, runs, rows = one_round()
    joined[0]["requests"] = 2  # asked twice (no reply in time): two replies are owed
    assert judged(joined, runs, rows, Counter({("r", "j0"): 2})).replies_repeated == 0


def test_a_merge_applied_twice_is_found() -> None:
    joined, runs, rows = one_round()
    runs["r"].append(merge(4, 1))
    assert judged(joined, runs, rows, Counter({("r", "j0"): 1})).problems == [
        "r: 2 merged checkpoints for 1 joins"
    ]


def test_a_reply_naming_another_checkpoint_is_found() -> None:
    joined, runs, rows = one_round()
    joined[0]["seq"] = 2
    problems = judged(joined, runs, rows, Counter({("r", "j0"): 1})).problems
    assert len(problems) == 1
    assert "answered seq 2" in problems[0]


def test_a_merge_that_lost_a_branch_is_found() -> None:
    joined, runs, rows = one_round()
    runs["r"][2] = {**merge(3, 1), "state": json.dumps({"history": [0]})}
    assert judged(joined, runs, rows, Counter({("r", "j0"): 1})).problems == [
        "('r', 'j0'): merged history [0]"
    ]


def test_a_join_on_record_without_a_reply_is_found() -> None:
    joined, runs, rows = one_round()
    # a join the orchestrator never saw answered (it stopped first) must be answered too
    problems = judged([], runs, rows, Counter()).problems
    assert problems == ["1 joins without a reply, e.g. [('r', 'j0')]"]
    assert judged(joined, runs, rows, Counter()).problems == problems
