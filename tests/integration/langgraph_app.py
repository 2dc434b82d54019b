"""The LangGraph application the tests drive, written as a LangGraph team writes one:
a ``StateGraph`` that plans, fans out with ``Send`` (results gathered by a reducer,
``Annotated[list, add]``), asks a human to approve (``interrupt``) and finishes.

Run as a program it is the process the crash test kills:
``python -m tests.integration.langgraph_app THREAD LOG CRASH_ITEM`` runs the graph on
AlmaSaver (settings from ``ALMA_*``) and dies (``os._exit``) inside the ``work`` task
of ``CRASH_ITEM`` once the other items' tasks have finished. Every ``work`` execution
appends its item to ``LOG``, so the test sees which tasks ran again after the restart.
"""

from __future__ import annotations

import asyncio
import operator
import os
import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Send, interrupt

GRAPH = "agent-graph"
TENANT = "acme"


class State(TypedDict, total=False):
    task: str
    items: list[str]
    results: Annotated[list[str], operator.add]
    approved: bool
    summary: str


class Item(TypedDict):
    item: str


def build(
    saver: BaseCheckpointSaver[Any],
    *,
    log: Path | None = None,
    crash_item: str | None = None,
    fail_item: str | None = None,
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The graph on ``saver``. ``crash_item``'s task kills the process once its siblings
    are done; ``fail_item``'s raises (a failed node)."""

    def plan(state: State) -> State:
        return {"items": [f"{state['task']} #{i}" for i in range(3)]}

    def fan_out(state: State) -> list[Send]:
        return [Send("work", {"item": item}) for item in state["items"]]

    async def work(state: Item) -> State:
        item = state["item"]
        if log is not None:
            with log.open("a") as f:
                f.write(item + "\n")
        if item == crash_item:
            await asyncio.sleep(1.5)  # the siblings finish and their writes are saved
            os._exit(9)
        if item == fail_item:
            raise RuntimeError(f"the source for {item!r} timed out after 30 s")
        return {"results": [f"done: {item}"]}

    def review(state: State) -> State:
        approved = interrupt({"question": "approve?", "results": state["results"]})
        return {"approved": bool(approved)}

    def finish(state: State) -> State:
        verdict = "approved" if state["approved"] else "rejected"
        return {"summary": f"{len(state['results'])} results, {verdict}"}

    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("work", work)
    graph.add_node("review", review)
    graph.add_node("finish", finish)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", fan_out, ["work"])
    graph.add_edge("work", "review")
    graph.add_edge("review", "finish")
    graph.add_edge("finish", END)
    return graph.compile(checkpointer=saver)


def config(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}


async def _crash_run(thread: str, log: Path, crash_item: str) -> None:
    from alma_core.integrations.langgraph import AlmaSaver
    from alma_core.settings import load

    async with AlmaSaver.from_settings(load(), tenant_id=TENANT, workflow_id=GRAPH) as saver:
        graph = build(saver, log=log, crash_item=crash_item)
        await graph.ainvoke({"task": "survey"}, config(thread))  # type: ignore[arg-type]
    sys.exit("the graph finished: the crash did not happen")


if __name__ == "__main__":
    asyncio.run(_crash_run(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
