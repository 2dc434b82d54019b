"""LangGraph 1.2's delta channels on AlmaSaver, beside LangGraph's own Postgres saver.

A ``DeltaChannel`` (the chat's ``messages``, :mod:`bench.langgraph_chat`)
is stored as the writes of each step plus a snapshot every few updates; a read rebuilds
it from the nearest snapshot and the writes after it. What must hold:

* a thread reads the same on both savers: every turn's answer, the final state, the
  whole history, a fork from an old checkpoint;
* ``aprune(keep_latest)`` never loses a message (LangGraph's saver refuses the call on
  such a thread; AlmaSaver keeps the latest checkpoint and the ones its delta channels
  are rebuilt from, nothing else);
* ``adelete_for_runs`` of an earlier run leaves every later state whole, and deletes
  what no later state needs;
* ``acopy_thread`` gives a thread that reads and goes on as the source does.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from langgraph.checkpoint.base import empty_checkpoint

from alma_core.integrations.langgraph import AlmaSaver
from alma_core.integrations.langgraph.saver import Wait
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from alma_core.storage import graphs
from bench import langgraph_chat as chat
from tests.integration.harness import Worker as AlmaWorker
from tests.integration.harness import count, fetch
from tests.integration.test_langgraph import postgres_saver


async def states(graph: Any, thread: str) -> list[tuple[Any, ...]]:
    """The thread's history, newest first: step, source, next nodes, values."""
    return [
        (s.metadata["step"], s.metadata["source"], s.next, s.values)
        async for s in graph.aget_state_history(chat.turn(thread))
    ]


def messages(n: int) -> list[str]:
    """What ``n`` turns from the start leave in ``messages``."""
    out: list[str] = []
    for i in range(n):
        out += [f"user {i}", f"echo {2 * i + 1}: user {i}"]
    return out


@pytest.mark.parametrize("wait", ["applied", "published"])
async def test_a_delta_channel_thread_reads_as_on_langgraphs_saver(
    settings: Settings, worker: AlmaWorker, empty_database: str, wait: Wait
) -> None:
    """Each turn answers from the whole history on both savers; the final state, the
    history (snapshots and the steps between them) and a fork agree."""
    thread = f"chat-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client, postgres_saver(empty_database) as reference:
        ours = chat.build(AlmaSaver(client, tenant_id="acme", workflow_id=chat.GRAPH, wait=wait))
        theirs = chat.build(reference)
        for i in range(11):  # past two snapshots (every 8 updates, two a turn)
            mine = await ours.ainvoke({"messages": [f"user {i}"]}, chat.turn(thread))
            assert mine == await theirs.ainvoke({"messages": [f"user {i}"]}, chat.turn(thread))
        assert mine == {"messages": messages(11), "turns": 11}
        history = await states(ours, thread)
        assert history == await states(theirs, thread)
        assert len(history) == 3 * 11  # input, start, reply: every state whole
        # a fork from the middle of the thread (between two snapshots) goes on from there
        for graph in (ours, theirs):
            past = [s async for s in graph.aget_state_history(chat.turn(thread))][14]
            forked = await graph.aupdate_state(past.config, {"messages": ["edited"]})
            await graph.ainvoke(None, forked)
        assert await states(ours, thread) == await states(theirs, thread)
        latest = (await ours.aget_state(chat.turn(thread))).values["messages"]
        assert latest[: latest.index("edited")] == history[14][3]["messages"]


async def test_prune_keep_latest_never_loses_a_message(
    settings: Settings, worker: AlmaWorker, empty_database: str
) -> None:
    """LangGraph's saver refuses keep_latest on a delta-channel thread; AlmaSaver prunes
    it and keeps the state: every message, the next turn as on the unpruned reference,
    and only the checkpoints the latest state is rebuilt from (back to the snapshot)."""
    thread = f"chat-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client, postgres_saver(empty_database) as reference:
        saver = AlmaSaver(client, tenant_id="acme", workflow_id=chat.GRAPH)
        ours, theirs = chat.build(saver), chat.build(reference)
        for graph in (ours, theirs):
            await chat.chat(graph, thread, 7)  # 14 updates: a snapshot at the 8th
        with pytest.raises(NotImplementedError, match="DeltaChannel"):
            await reference.aprune([thread], strategy="keep_latest")
        before = await states(ours, thread)
        assert before[0][3] == {"messages": messages(7), "turns": 7}
        await saver.aprune([thread], strategy="keep_latest")
        after = await states(ours, thread)
        # what is left reads as it did: the latest state, and its ancestors back to the
        # snapshot (the only one holding `messages`), nothing older
        assert after == before[: len(after)]
        assert 1 < len(after) < len(before)
        assert await holding(settings, thread) == [len(after) - 1]
        for graph in (ours, theirs):
            await chat.chat(graph, thread, 3, start=7)
        assert (await ours.aget_state(chat.turn(thread))).values == (
            await theirs.aget_state(chat.turn(thread))
        ).values
        # pruned again once the latest state is a snapshot (every 4th turn): only it stays
        await chat.chat(ours, thread, 2, start=10)
        await saver.aprune([thread], strategy="keep_latest")
        assert await states(ours, thread) == [
            (34, "loop", (), {"messages": messages(12), "turns": 12})
        ]


async def holding(settings: Settings, thread: str) -> list[int]:
    """The positions (newest first) of the thread's checkpoints that hold ``messages``
    (their version of it is a snapshot's, stored whole), not only deltas."""
    rows = await fetch(
        settings.postgres_dsn or "",
        """SELECT EXISTS (SELECT 1 FROM graph_blobs b
                          WHERE b.tenant_id = c.tenant_id AND b.thread_id = c.thread_id
                            AND b.channel = 'messages'
                            AND b.version = c.checkpoint->'channel_versions'->>'messages')
                  AS holds
           FROM graph_checkpoints c
           WHERE c.tenant_id = 'acme' AND c.thread_id = $1 ORDER BY c.checkpoint_id DESC""",
        thread,
    )
    return [i for i, r in enumerate(rows) if r["holds"]]


@pytest.mark.parametrize(("a_turns", "a_left"), [(2, 6), (5, 3)])
async def test_deleting_earlier_runs_leaves_every_later_state_whole(
    settings: Settings, worker: AlmaWorker, a_turns: int, a_left: int
) -> None:
    """A thread's first turns (each a run), then one more: deleting the first runs keeps
    every later state whole. Before the first snapshot (the 8th update, in the 4th turn)
    the later states are rebuilt from all of the deleted runs' steps, which stay; after
    it, from the first checkpoint holding the snapshot on (step 11, the turn after
    it: the snapshot's value is stored once for its version), and the deleted runs'
    checkpoints before it go."""
    thread = f"chat-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client:
        saver = AlmaSaver(client, tenant_id="acme", workflow_id=chat.GRAPH)
        graph = chat.build(saver)
        first = await chat.chat(graph, thread, a_turns)
        await chat.chat(graph, thread, 1, start=a_turns)
        later = (await states(graph, thread))[:3]
        assert later[0][3] == {"messages": messages(a_turns + 1), "turns": a_turns + 1}
        await saver.adelete_for_runs(first)
        assert (await states(graph, thread))[:3] == later
        left = await count(
            settings.postgres_dsn or "",
            "SELECT count(*) FROM graph_checkpoints WHERE thread_id = $1 AND run_id = ANY($2)",
            thread,
            first,
        )
        assert left == a_left  # all (3 a turn); or steps 11 to 13


async def test_a_copied_thread_reads_and_goes_on_as_its_source(
    settings: Settings, worker: AlmaWorker
) -> None:
    source, target = f"chat-{uuid.uuid4().hex[:8]}", f"copy-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client:
        saver = AlmaSaver(client, tenant_id="acme", workflow_id=chat.GRAPH)
        graph = chat.build(saver)
        await chat.chat(graph, source, 7)
        await saver.acopy_thread(source, target)
        assert await states(graph, target) == await states(graph, source)
        for thread in (source, target):
            await chat.chat(graph, thread, 2, start=7)
        assert (await graph.aget_state(chat.turn(target))).values == {
            "messages": messages(9),
            "turns": 9,
        }
        assert await states(graph, target) == await states(graph, source)


async def test_a_looping_chain_of_parents_is_read_to_a_bound_not_forever(
    settings: Settings, worker: AlmaWorker
) -> None:
    """Checkpoint ids come from the producer: two checkpoints each naming the other as
    its parent (a hostile or broken writer) make no endless walk."""
    thread = f"loop-{uuid.uuid4().hex[:8]}"
    async with AlmaClient(settings) as client:
        saver = AlmaSaver(client, tenant_id="acme", workflow_id=chat.GRAPH)
        ids = ["1f000000-0000-6000-8000-00000000000a", "1f000000-0000-6000-8000-00000000000b"]
        for own, parent in (ids, ids[::-1]):
            checkpoint = empty_checkpoint()
            checkpoint["id"] = own
            checkpoint["channel_versions"] = {"messages": saver.get_next_version(None, None)}
            config = {
                "configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": parent}
            }
            await saver.aput(
                config, checkpoint, {"counters_since_delta_snapshot": {"messages": [1, 1]}}, {}
            )
            await saver.aput_writes(
                {"configurable": {**config["configurable"], "checkpoint_id": own}},
                [("messages", ["hi"])],
                task_id=f"task-{own[-1]}",
            )
        target = {
            "configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": ids[0]}
        }
        history = await asyncio.wait_for(
            saver.aget_delta_channel_history(config=target, channels=["messages"]), 30
        )
    assert "seed" not in history["messages"]  # no value anywhere: the walk ran to its bound
    assert 0 < len(history["messages"]["writes"]) <= graphs.MAX_WALK
