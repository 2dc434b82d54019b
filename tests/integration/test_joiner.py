"""The joiner on the real services: fan-out/fan-in through the SDK, idempotent
replies, error replies, and a reply lost to a crash."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from alma_core import errors
from alma_core.quotas import TenantLimits
from alma_core.reducers import ReducerRegistry, default_registry
from alma_core.schemas.decoder import decode
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage.batches import Incoming
from alma_core.storage.joins import JoinConfig, PostgresJoinStore
from alma_core.storage.postgres import connect
from alma_core.types import WorkflowContext
from tests.integration.harness import (
    Publisher,
    Worker,
    completed,
    count,
    fetch,
    read_topic,
    register_reducers,
    wait_for,
    worker_env,
)

REDUCERS = {"log": "append", "total": "sum", "best": "max", "info": "merge_dict", "tag": "longest"}


def longest(current: Any, update: Any) -> Any:
    return update if len(str(update)) > len(str(current)) else current


@pytest.fixture
async def stack(settings: Settings) -> AsyncIterator[tuple[Worker, AlmaClient]]:
    if "longest" not in default_registry():
        default_registry().register("longest", longest)
    async with (
        Worker.start(settings, ("checkpointer", "joiner")) as worker,
        AlmaClient(settings) as client,
    ):
        yield worker, client


async def fan_out(settings: Settings, run: str, branches: int) -> None:
    async with Publisher(settings.kafka_bootstrap or "", settings.lifecycle_topic) as pub:
        await pub.send(
            completed(
                run,
                node="start",
                updates={"log": ["start"], "total": 10, "best": 1, "info": {"a": 1}, "tag": "s"},
            )
        )
        for i in range(branches):
            await pub.send(
                completed(
                    run,
                    node=f"work{i}",
                    branch=f"b{i}",
                    updates={
                        "log": [f"b{i}"],
                        "total": i,
                        "best": (i * 3) % 7,
                        "info": {"b": i},
                        "tag": "t" * (i % 3 + 1),
                    },
                )
            )
        await pub.flush()


def ctx(run: str) -> WorkflowContext:
    return WorkflowContext(tenant_id="acme", workflow_id="wf", run_id=run, node_id="join")


async def test_fan_out_fan_in_many_runs(
    settings: Settings, stack: tuple[Worker, AlmaClient]
) -> None:
    _, client = stack
    dsn = settings.postgres_dsn
    assert dsn
    runs = [f"fan-{i}" for i in range(8)]
    await asyncio.gather(*(fan_out(settings, run, 5) for run in runs))
    order = ["b4", "b2", "b0", "b1", "b3"]

    async def merge(run: str) -> Any:
        return await client.merge(ctx(run), branch_ids=order, reducers=REDUCERS, timeout=60)

    replies = await asyncio.gather(*(merge(run) for run in runs))
    expected = {
        "log": ["start", *order],  # the main line first, then the branches in the order given
        "total": 10 + sum(range(5)),
        "best": max([1] + [(i * 3) % 7 for i in range(5)]),
        "info": {"a": 1, "b": 3},  # merge_dict: the last branch given wins "b"
        "tag": "ttt",
    }
    for run, reply in zip(runs, replies, strict=True):
        assert reply.status == "ok"
        assert reply.merged_state == expected
        assert reply.checkpoint_seq == 7  # after 1 main-line and 5 branch checkpoints
        rows = await fetch(
            dsn,
            "SELECT kind, merged_from, parent_seq, state FROM checkpoints "
            "WHERE run_id = $1 AND seq = 7",
            run,
        )
        assert rows[0]["kind"] == "merge"
        assert rows[0]["parent_seq"] == 1
        assert rows[0]["state"] == expected
        branch_seq = {f"b{i}": i + 2 for i in range(5)}
        assert list(rows[0]["merged_from"]) == [branch_seq[b] for b in order]


@pytest.mark.smoke
async def test_same_join_twice_one_checkpoint_identical_replies(
    settings: Settings, stack: tuple[Worker, AlmaClient]
) -> None:
    _, client = stack
    dsn = settings.postgres_dsn
    assert dsn
    await fan_out(settings, "twice", 2)
    first = await client.merge(ctx("twice"), branch_ids=["b0", "b1"], join_id="j-1", timeout=60)
    again = await client.merge(ctx("twice"), branch_ids=["b0", "b1"], join_id="j-1", timeout=60)
    assert first == again
    assert await count(dsn, "SELECT count(*) FROM checkpoints WHERE kind = 'merge'") == 1
    records = await read_topic(settings.kafka_bootstrap or "", settings.merged_topic, 2)
    mine = [r for r in records if dict(r.headers)["alma.join_id"] == b"j-1"]
    assert len(mine) == 2
    assert mine[0].value == mine[1].value
    assert mine[0].key == b"twice"


@pytest.mark.parametrize(
    ("kwargs", "reason", "names"),
    [
        ({"branch_ids": ["b0", "nope"]}, "missing_branch", "'nope'"),
        (
            {"branch_ids": ["b0", "b1"], "reducers": {"log": "median"}},
            "unknown_reducer",
            "'median'",
        ),
        (
            {"branch_ids": ["b0", "b1"], "reducers": {"log": "append"}, "strict": True},
            "strict_conflict",
            "received 2 different values",
        ),
    ],
)
async def test_errors_answer_and_dead_letter(
    settings: Settings,
    stack: tuple[Worker, AlmaClient],
    kwargs: dict[str, Any],
    reason: str,
    names: str,
) -> None:
    _, client = stack
    dsn = settings.postgres_dsn
    assert dsn
    run = f"err-{uuid.uuid4().hex[:6]}"
    await fan_out(settings, run, 2)
    await wait_for(lambda: count(dsn, "SELECT count(*) FROM checkpoints WHERE run_id = $1", run))
    with pytest.raises(errors.MergeFailed, match=reason) as info:
        await client.merge(ctx(run), timeout=60, **kwargs)
    assert names in info.value.message
    if reason == "strict_conflict":
        assert re.search(r"field '(total|best|info|tag)'", info.value.message)
    letters = await fetch(dsn, "SELECT consumer, reason FROM dead_letters")
    assert [(r["consumer"], r["reason"]) for r in letters] == [("joiner", reason)]
    # Nothing is stuck: the next join of the run is answered.
    ok = await client.merge(
        ctx(run), branch_ids=["b0", "b1"], reducers={"log": "append"}, timeout=60
    )
    assert ok.status == "ok"


async def test_states_join_and_registered_reducers(
    settings: Settings, stack: tuple[Worker, AlmaClient]
) -> None:
    _, client = stack
    dsn = settings.postgres_dsn
    assert dsn
    await register_reducers(dsn, "wf", {"n": "sum", "seen": "union"})
    await fan_out(settings, "given", 1)
    reply = await client.merge(
        ctx("given"), states=[{"n": 1, "seen": [1, 2]}, {"n": 2, "seen": [2, 3]}], timeout=60
    )
    assert reply.merged_state == {"n": 3, "seen": [1, 2, 3]}


async def test_reply_lost_to_a_crash_is_sent_on_recovery(settings: Settings) -> None:
    """The joiner committed the merged checkpoint and died before publishing the reply:
    the reply is in the outbox, and the next worker sends exactly that reply."""
    dsn = settings.postgres_dsn
    assert dsn
    async with Worker.start(settings):  # the checkpointer alone: branch checkpoints
        await fan_out(settings, "lost", 2)

        async def three() -> bool:
            return await count(dsn, "SELECT count(*) FROM checkpoints") == 3

        await wait_for(three, what="the branch checkpoints")
    join = {
        "event_id": "j-lost",
        "type": "branch.join",
        "emitted_at": "2026-11-22T10:00:00Z",
        "tenant_id": "acme",
        "workflow_id": "wf",
        "run_id": "lost",
        "payload": {"join_id": "lost-1", "branch_ids": ["b0", "b1"]},
    }
    raw = json.dumps(join).encode()
    async with connect(dsn) as pool:
        store = PostgresJoinStore(
            pool,
            JoinConfig(
                f"{settings.group_prefix}-joiner",
                "joiner",
                settings.merged_topic,
                settings.dlq_topic,
                settings.max_state_bytes,
            ),
            ReducerRegistry(),
        )
        record = Incoming(settings.sequenced_topic, 0, 0, b"lost", raw, decode(raw))
        result = await store.transact(
            "crashed", {(settings.sequenced_topic, 0): [record]}, TenantLimits()
        )
    assert result.effects is not None
    assert result.effects.outcomes["ok"] == 1  # durable, but never published: the crash
    async with Worker.start(settings, ("joiner",)):
        records = await read_topic(settings.kafka_bootstrap or "", settings.merged_topic, 1)
    reply = json.loads(records[0].value)
    assert (reply["join_id"], reply["status"], reply["checkpoint_seq"]) == ("lost-1", "ok", 4)
    assert await count(dsn, "SELECT count(*) FROM checkpoints WHERE kind = 'merge'") == 1


async def test_the_fan_out_example_runs(settings: Settings, tmp_path: Path) -> None:
    """examples/fan_out_fan_in.py against running workers, as a user runs it."""
    example = Path(__file__).parents[2] / "examples" / "fan_out_fan_in.py"
    env = {**worker_env(settings), "PYTHONPATH": str(Path(__file__).parents[2])}
    async with Worker.start(settings, ("checkpointer", "joiner")):
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(example)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    assert "merged checkpoint seq 5" in result.stdout
    merged = json.loads(result.stdout.split("\n", 1)[1])
    assert merged["cost"] == pytest.approx(1.5)
    assert merged["score"] == 0.9
    assert merged["findings"] == [
        "HNSW is fast",
        "IVF needs training",
        "exact scan wins below 10k rows",
    ]


async def test_several_clients_share_one_reply_topic(
    settings: Settings, stack: tuple[Worker, AlmaClient]
) -> None:
    """Each client gets its own replies and ignores the others'."""
    _, first = stack
    async with AlmaClient(settings) as second:
        runs = [f"shared-{i}" for i in range(6)]
        await asyncio.gather(*(fan_out(settings, run, 2) for run in runs))
        clients = [first, second]

        async def ask(i: int, run: str) -> Any:
            return await clients[i % 2].merge(
                ctx(run), branch_ids=["b0", "b1"], join_id=f"{run}-join", timeout=60
            )

        replies = await asyncio.gather(*(ask(i, run) for i, run in enumerate(runs)))
    assert [r.join_id for r in replies] == [f"{run}-join" for run in runs]
    assert [r.run_id for r in replies] == runs


async def test_a_reply_for_another_tenant_never_answers_a_join(settings: Settings) -> None:
    """The reply topic is shared by every tenant and a join_id is unique only per run:
    a reply naming the same run and join of another tenant (or a garbled one) must not
    resolve the wait; the right one does."""
    from alma_core.schemas.events import MergeReply
    from alma_core.sdk.replies import ReplyListener

    bootstrap = settings.kafka_bootstrap or ""
    listener = ReplyListener(bootstrap, settings.merged_topic, fetch_max_wait_ms=50)
    try:
        future = await listener.expect(("acme", "r1", "j1"))
        headers = [("alma.join_id", b"j1")]

        def reply(tenant: str) -> bytes:
            return (
                MergeReply(
                    join_id="j1",
                    run_id="r1",
                    tenant_id=tenant,
                    status="ok",
                    merged_state={"who": tenant},
                    checkpoint_seq=3,
                )
                .model_dump_json()
                .encode()
            )

        async with Publisher(bootstrap, settings.merged_topic) as pub:
            await pub.send(reply("globex"), key="r1", headers=headers)
            await pub.send(b"{garbled", key="r1", headers=headers)
            await pub.flush()
            await asyncio.sleep(1.5)  # several fetches: both were read and ignored
            assert not future.done()
            await pub.send(reply("acme"), key="r1", headers=headers)
            await pub.flush()
        answer = await asyncio.wait_for(future, 30)
        assert answer.tenant_id == "acme"
        assert answer.merged_state == {"who": "acme"}
    finally:
        await listener.stop()


async def test_a_join_takes_its_place_in_the_partition_or_fails_clearly(
    settings: Settings,
) -> None:
    """Events published after a join without waiting for its reply are applied by the
    checkpointer before the joiner merges. The merge must not fold them in nor take a
    seq after theirs (order); it is answered with a clear error instead, and seqs stay
    gapless. A join whose run has not moved is merged as usual."""
    from tests.integration.harness import event

    dsn, bootstrap = settings.postgres_dsn or "", settings.kafka_bootstrap or ""
    async with Publisher(bootstrap, settings.lifecycle_topic) as pub:
        for run in ("moved", "still"):
            await pub.send(completed(run, node="a", branch="a", updates={"xs": ["a"]}))
            await pub.send(completed(run, node="b", branch="b", updates={"xs": ["b"]}))
            await pub.send(
                event(
                    "branch.join",
                    run,
                    node="join",
                    join_id="j",
                    branch_ids=["a", "b"],
                    reducers={"xs": "append"},
                )
            )
        await pub.send(completed("moved", node="after", updates={"xs": ["after"]}))
        await pub.flush()
    async with Worker.start(settings, ("checkpointer",)):  # the joiner is not running yet

        async def applied() -> bool:
            return await count(dsn, "SELECT count(*) FROM run_events") == 7

        await wait_for(applied, what="every event before the joiner starts")
    async with Worker.start(settings, ("checkpointer", "joiner")):

        async def answered() -> bool:
            return await count(dsn, "SELECT count(*) FROM joins") == 2

        await wait_for(answered, what="both joins answered")
    joins = {r["run_id"]: r for r in await fetch(dsn, "SELECT run_id, status, reply FROM joins")}
    assert joins["moved"]["status"] == "error"
    assert "run_moved_past_join" in joins["moved"]["reply"]["error"]
    assert joins["still"]["status"] == "ok"
    assert joins["still"]["reply"]["merged_state"] == {"xs": ["a", "b"]}
    for run, kinds in (("moved", ["node", "node", "node"]), ("still", ["node", "node", "merge"])):
        rows = await fetch(
            dsn, "SELECT seq, kind FROM checkpoints WHERE run_id = $1 ORDER BY seq", run
        )
        assert [r["seq"] for r in rows] == [1, 2, 3]
        assert [r["kind"] for r in rows] == kinds
    letters = await fetch(dsn, "SELECT consumer, reason FROM dead_letters")
    assert [(r["consumer"], r["reason"]) for r in letters] == [("joiner", "run_moved_past_join")]


async def test_a_loop_of_fan_outs_reusing_branch_names_merges_each_write_once(
    settings: Settings, stack: tuple[Worker, AlmaClient]
) -> None:
    """A join consumes its branches: the next fan-out with the same branch names (a
    loop, or two parallel steps of one workflow) starts them from empty, so nothing
    of the first fan-out is merged again."""
    _, client = stack
    run = WorkflowContext(
        tenant_id="acme", workflow_id="loop", run_id=f"loop-{uuid.uuid4().hex[:6]}"
    )
    await client.register_reducers(run, {"items": "append", "count": "sum"})
    start = await client.node_completed(replace(run, node_id="start"), updates={"items": ["s"]})
    await client.applied(run, start)
    merged: list[dict[str, Any]] = []
    for round_ in ("first", "second", "third"):
        for branch in ("a", "b"):
            at = replace(run, node_id=f"work-{branch}", branch_id=branch)
            done = await client.node_completed(
                at, updates={"items": [f"{round_}-{branch}"], "count": 1}
            )
            await client.applied(at, done)
        reply = await client.merge(
            replace(run, node_id=f"join-{round_}"), branch_ids=["a", "b"], timeout=60
        )
        merged.append(reply.merged_state or {})
    assert merged[-1]["items"] == [
        "s",
        "first-a",
        "first-b",
        "second-a",
        "second-b",
        "third-a",
        "third-b",
    ]
    assert [m["count"] for m in merged] == [2, 4, 6]
    # joining branches that wrote nothing since their last join is an error
    with pytest.raises(errors.MergeFailed, match="missing_branch"):
        await client.merge(replace(run, node_id="again"), branch_ids=["a"], timeout=60)
    # the branch heads are gone from the cache and the store alike
    point = await client.resume(run)
    assert set(point.branch_heads) == {None}
