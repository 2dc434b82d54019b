"""Merging parallel branches: ALMA Stream's reducers (``joining.merge``: the reducers,
then canonical JSON, the size check and the state hash the checkpoint needs)
versus LangGraph's reducer application (``BinaryOperatorAggregate.update`` per
field, branches in its alphabetical order) on the same branch states. No I/O on
either side: this is the CPU each pays per join. Side by side at 5 branches of
5 KB, and the cost curves against branch count and state size."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any

from langgraph.channels import BinaryOperatorAggregate

from alma_core.joining import merge
from alma_core.reducers import ReducerRegistry
from alma_core.schemas.events import BranchJoinPayload
from alma_core.sequencing import Head, state_hash
from bench.env import Env
from bench.report import Section, Stat, pct, ratio

REDUCERS = {"log": "append", "cost": "sum", "score": "max", "facts": "merge_dict"}
LG_REDUCERS: dict[str, tuple[type, Callable[[Any, Any], Any]]] = {
    "log": (list, operator.add),
    "cost": (int, operator.add),
    "score": (int, lambda a, b: max(a, b)),
    "facts": (dict, lambda a, b: {**a, **b}),
}


def branch_state(i: int, size: int) -> dict[str, Any]:
    """A branch's writes: a log line, a cost, a score and ``size`` bytes of facts."""
    return {
        "log": [f"branch {i} done"],
        "cost": i + 1,
        "score": i % 7,
        "facts": {
            f"b{i}-k{j}": f"value {j} of branch {i} " + "v" * 30 for j in range(max(1, size // 60))
        },
    }


def alma_merge(branches: int, size: int, samples: int) -> list[float]:
    heads = {f"b{i:02d}": Head(i + 2, "", branch_state(i, size)) for i in range(branches)}
    main = Head(1, state_hash({"log": []}), {"log": []})
    payload = BranchJoinPayload.model_validate(
        {"join_id": "j", "branch_ids": list(heads), "reducers": REDUCERS}, strict=False
    )
    registry = ReducerRegistry()
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        merge(
            payload,
            main=main,
            branches=heads,
            registered=None,
            registry=registry,
            max_state_bytes=2**31 - 1,
        )
        out.append(time.perf_counter() - started)
    return out


def langgraph_merge(branches: int, size: int, samples: int) -> list[float]:
    writes = [branch_state(i, size) for i in range(branches)]  # sorted by node name
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        for key, (typ, op) in LG_REDUCERS.items():
            channel = BinaryOperatorAggregate(typ, op)
            channel.update([w[key] for w in writes])
            channel.get()
        out.append(time.perf_counter() - started)
    return out


def samples_for(branches: int, size: int, quick: bool) -> int:
    work = branches * size
    n = 400 if work <= 50_000 else 100 if work <= 1_000_000 else 10
    return max(5, n // 4) if quick else n


def paired(env: Env, branches: int, size: int) -> dict[str, Stat]:
    n = env.fewer(samples_for(branches, size, env.quick))
    a, lg = [], []
    for _ in range(env.reps):
        a.append(pct(alma_merge(branches, size, n), 50) * 1000)
        lg.append(pct(langgraph_merge(branches, size, n), 50) * 1000)
    alma_s, lg_s = Stat(a, 3), Stat(lg, 3)
    return {"alma": alma_s, "lg": lg_s, "ratio": ratio(alma_s, lg_s, 1)}


BRANCHES = (2, 4, 8, 16, 32, 64)
SIZES = (1_000, 10_000, 100_000, 1_000_000)


def run(env: Env, side: Section | None, curves: Section | None) -> None:
    """The 5-branch merge into ``side``; the curves into ``curves``."""
    headers = [
        "branches",
        "state per branch",
        "ALMA merge p50 ms",
        "LangGraph reducers p50 ms",
        "ALMA ÷ LangGraph",
    ]
    if side is not None:
        env.step("merge of 5 branches")
        side.table("merge", "Merge of 5 branches (5 KB each), CPU only", headers)
        r = paired(env, 5, 5_000)
        side.add("merge", [5, "5 KB", r["alma"], r["lg"], r["ratio"]])
        env.done()
    if curves is None:
        return
    curves.table("merge_branches", "Merge cost against branch count (5 KB per branch)", headers)
    curves.table("merge_size", "Merge cost against state size (5 branches)", headers)
    env.step("merge cost curves")
    for branches in BRANCHES:
        r = paired(env, branches, 5_000)
        curves.add("merge_branches", [branches, "5 KB", r["alma"], r["lg"], r["ratio"]])
    env.done()
    for size in SIZES:
        r = paired(env, 5, size)
        label = f"{size // 1000:,} KB" if size < 1_000_000 else "1 MB"
        curves.add("merge_size", [5, label, r["alma"], r["lg"], r["ratio"]])
    env.done()
