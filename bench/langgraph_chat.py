"""A LangGraph 1.2 chat graph whose history is a ``DeltaChannel``, written as a LangGraph
team writes one: each turn appends the user's message and the agent's reply to
``messages``, which LangGraph stores as per-step deltas with a full snapshot every
``snapshot_every`` updates (langgraph/channels/delta.py). What the delta-channel tests
(tests/integration/test_langgraph_delta.py) and the benchmark drive on both savers."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Annotated, Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

GRAPH = "chat-graph"


def append(state: list[str], writes: Sequence[list[str]]) -> list[str]:
    """The channel's reducer: deterministic and the same in one batch or several."""
    return [*state, *(m for batch in writes for m in batch)]


def build(
    saver: BaseCheckpointSaver[Any], snapshot_every: int = 8
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The graph on ``saver``; ``messages`` snapshots every ``snapshot_every`` updates
    (two a turn; LangGraph's default is 100)."""
    channel = DeltaChannel(append, snapshot_frequency=snapshot_every)
    Chat = TypedDict(  # noqa: UP013 (the channel is built per graph)
        "Chat", {"messages": Annotated[list[str], channel], "turns": int}, total=False
    )

    def reply(state: Any) -> Any:
        heard = state["messages"][-1]
        return {
            "messages": [f"echo {len(state['messages'])}: {heard}"],
            "turns": 1 + state.get("turns", 0),
        }

    graph = StateGraph(Chat)
    graph.add_node("reply", reply)
    graph.add_edge(START, "reply")
    graph.add_edge("reply", END)
    return graph.compile(checkpointer=saver)


def turn(thread: str, run_id: str | None = None) -> RunnableConfig:
    """A turn's config: the thread, and the LangGraph run the turn is (as LangGraph's
    server sets it, one per invocation: the checkpoints' ``run_id``, what
    ``adelete_for_runs`` names)."""
    return {
        "configurable": {"thread_id": thread},
        "metadata": {"run_id": run_id or str(uuid.uuid4())},
    }


async def chat(graph: Any, thread: str, turns: int, *, start: int = 0) -> list[str]:
    """``turns`` user messages, each answered in a run of its own; the runs' ids."""
    runs = [str(uuid.uuid4()) for _ in range(turns)]
    for i, run_id in enumerate(runs, start):
        await graph.ainvoke({"messages": [f"user {i}"]}, turn(thread, run_id))
    return runs
