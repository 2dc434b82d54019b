"""The checkpointer's memory of its own writes (pure: what it holds, what it gives back,
what it lets go)."""

from __future__ import annotations

from dataclasses import replace

from alma_core.reducers import ReducerConfig
from alma_core.sequencing import CheckpointRow, Head, RunView
from alma_core.storage.run_memory import RUN_BYTES, RunMemory

TP = ("lifecycle", 0)


def view(run: str, last_seq: int = 1) -> RunView:
    return RunView(run, "acme", "wf", None, last_seq=last_seq, event_count=last_seq, changed=True)


def row(run: str, seq: int, state_json: str, branch: str | None = None) -> CheckpointRow:
    return CheckpointRow(
        run_id=run,
        seq=seq,
        tenant_id="acme",
        kind="node",
        node_id="n",
        branch_id=branch,
        parent_seq=None,
        event_id=f"e{seq}",
        state={},
        state_json=state_json,
        state_hash=f"h{seq}",
        size_bytes=len(state_json),
        metadata={},
    )


def test_a_run_written_with_its_states_is_recalled_as_written() -> None:
    memory = RunMemory(1 << 20)
    memory.remember(
        {TP: 5},
        [(view("r", 2), "101")],
        {},
        {("acme", "r", ""): row("r", 2, '{"n":2}'), ("acme", "r", "b"): row("r", 1, '{"b":1}')},
        {("acme", "r")},
        {("acme", "wf"): (None, None)},
        recalled=False,
    )
    got = memory.recall([TP], [("acme", "r")], {("acme", "r")}, [("acme", "wf")])
    assert got is not None
    assert got.stored == {TP: 5}
    assert got.versions == {("acme", "r"): "101"}
    assert got.runs[("acme", "r")].last_seq == 2
    assert not got.runs[("acme", "r")].changed
    assert got.heads == {
        ("acme", "r", ""): Head(2, "h2", {"n": 2}),
        ("acme", "r", "b"): Head(1, "h1", {"b": 1}),
    }
    assert got.config_versions == {("acme", "wf"): None}
    assert got.configs == {}
    got.runs[("acme", "r")].last_seq = 99  # the fold changes its copy, not memory
    again = memory.recall([TP], [("acme", "r")], set(), [])  # folds into no head
    assert again is not None
    assert again.runs[("acme", "r")].last_seq == 2
    assert again.heads[("acme", "r", "")] == Head(2, "h2", {})  # as a read: no state
    # written again, from memory, without needing the states: they are still held
    memory.remember(
        {TP: 6},
        [(view("r", 3), "102")],
        again.heads,
        {("acme", "r", ""): row("r", 3, '{"n":3}')},
        again.states_known,
        {},
        recalled=True,
    )
    last = memory.recall([TP], [("acme", "r")], {("acme", "r")}, [])
    assert last is not None
    assert last.heads == {
        ("acme", "r", ""): Head(3, "h3", {"n": 3}),
        ("acme", "r", "b"): Head(1, "h1", {"b": 1}),
    }


def test_what_memory_does_not_hold_is_read() -> None:
    memory = RunMemory(1 << 20)
    sums = ReducerConfig(field_reducers={"n": "sum"})
    memory.remember(
        {TP: 5},
        [(view("r"), "7")],
        {("acme", "r", ""): Head(1, "h1", {"n": 1})},  # read without its state
        {},
        set(),
        {("acme", "wf"): (sums, "9")},
        recalled=False,
    )
    assert memory.recall([("lifecycle", 1)], [("acme", "r")], set(), []) is None  # partition
    assert memory.recall([TP], [("acme", "other")], set(), []) is None  # run
    assert memory.recall([TP], [("acme", "r")], set(), [("acme", "wf2")]) is None  # workflow
    assert memory.recall([TP], [("acme", "r")], {("acme", "r")}, []) is None  # its state
    got = memory.recall([TP], [("acme", "r")], set(), [("acme", "wf")])
    assert got is not None
    assert got.heads == {("acme", "r", ""): Head(1, "h1", {})}
    assert got.configs == {("acme", "wf"): sums}
    assert got.config_versions == {("acme", "wf"): "9"}
    assert (memory.recalled, memory.missed) == (1, 4)
    memory.forget([("acme", "r")], [TP])
    assert memory.recall([TP], [("acme", "r")], set(), []) is None


def test_the_least_recently_written_runs_go_first_past_the_budget() -> None:
    memory = RunMemory(2 * RUN_BYTES + 25)  # two runs and their states
    for i, run in enumerate(("a", "b", "c")):
        memory.remember(
            {TP: i + 1},
            [(view(run), str(i))],
            {},
            {("acme", run, ""): row(run, 1, '{"x":"' + "y" * 4 + '"}')},  # 12 bytes
            {("acme", run)},
            {},
            recalled=False,
        )
    assert memory.size == 2 * RUN_BYTES + 24
    assert memory.recall([TP], [("acme", "a")], set(), []) is None  # went first
    assert memory.recall([TP], [("acme", "c")], set(), []) is not None
    memory.remember(
        {TP: 9},
        [(replace(view("b"), last_seq=2), "5")],
        {},
        {("acme", "b", ""): row("b", 2, '{"x":"' + "y" * 10 + '"}')},  # 18 bytes
        {("acme", "b")},
        {},
        recalled=False,
    )
    assert memory.size == RUN_BYTES + 18  # "c" went, "b" was replaced
    got = memory.recall([TP], [("acme", "b")], {("acme", "b")}, [])
    assert got is not None
    assert got.stored == {TP: 9}
    assert got.versions == {("acme", "b"): "5"}
