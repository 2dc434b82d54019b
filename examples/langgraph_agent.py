"""A LangGraph research agent with ALMA Stream as its checkpointer and its memory.

    alma up                                      # in one terminal
    python examples/langgraph_agent.py           # in another

The graph is plain LangGraph: it plans a few searches, runs them at once with ``Send``
(the findings gathered by a reducer), asks a human to approve the report
(``interrupt``) and writes it. The only ALMA Stream code is the checkpointer,
``AlmaSaver``, and ``acomplete`` once a thread is done, so ALMA learns from it.

Two threads: one approved, one whose search source fails (the thread fails, its error
is learned). Then the agent asks ALMA what the graph's earlier threads taught
(``retrieve``) before a third topic, which LangGraph alone cannot answer.
"""

from __future__ import annotations

import asyncio
import operator
import uuid
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt

from alma_core.integrations.langgraph import AlmaSaver
from alma_core.settings import load_running
from alma_core.types import WorkflowContext

TENANT, GRAPH = "agtestari", "research-agent"
BROKEN_SOURCE = "patents"  # this source times out: a thread that searches it fails


class Report(TypedDict, total=False):
    topic: str
    queries: list[str]
    findings: Annotated[list[str], operator.add]
    approved: bool
    report: str


class Search(TypedDict):
    query: str


def plan(state: Report) -> Report:
    return {"queries": [f"{state['topic']} in {s}" for s in ("news", "papers", "forums")]}


def search_all(state: Report) -> list[Send]:
    return [Send("search", {"query": q}) for q in state["queries"]]


async def search(state: Search) -> Report:
    await asyncio.sleep(0.05)  # the search engine
    if BROKEN_SOURCE in state["query"]:
        raise TimeoutError(f"search {state['query']!r} timed out after 30 s")
    return {"findings": [f"3 results for {state['query']!r}"]}


def review(state: Report) -> Report:
    decision = interrupt({"approve": f"{len(state['findings'])} findings on {state['topic']}"})
    return {"approved": decision == "yes"}


def write(state: Report) -> Report:
    verdict = "published" if state["approved"] else "shelved"
    return {"report": f"{state['topic']}: {'; '.join(sorted(state['findings']))} ({verdict})"}


def build(saver: AlmaSaver) -> Any:
    graph = StateGraph(Report)
    for name, node in (("plan", plan), ("search", search), ("review", review), ("write", write)):
        graph.add_node(name, node)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", search_all, ["search"])
    graph.add_edge("search", "review")
    graph.add_edge("review", "write")
    graph.add_edge("write", END)
    return graph.compile(checkpointer=saver)


async def research(saver: AlmaSaver, graph: Any, topic: str) -> None:
    thread = f"{topic.replace(' ', '-')}-{uuid.uuid4().hex[:6]}"
    config = {"configurable": {"thread_id": thread}}
    task = f"research {topic}"
    try:
        paused = await graph.ainvoke({"topic": topic}, config)
        print(f"{thread}: the human is asked: {paused['__interrupt__'][0].value['approve']}")
        done = await graph.ainvoke(Command(resume="yes"), config)  # approved
        print(f"{thread}: {done['report']}")
    except TimeoutError as exc:
        print(f"{thread}: failed ({exc})")
    outcome = await saver.acomplete(thread, task=task)  # ALMA learns from the thread
    print(
        f"  outcome {outcome} published; history: {len(await history(graph, config))} checkpoints"
    )


async def history(graph: Any, config: dict[str, Any]) -> list[Any]:
    return [s async for s in graph.aget_state_history(config)]


async def main() -> None:
    async with AlmaSaver.from_settings(
        load_running(), tenant_id=TENANT, workflow_id=GRAPH
    ) as saver:
        graph = build(saver)
        await research(saver, graph, "heat pumps")
        await research(saver, graph, "heat pump patents")
        scope = WorkflowContext(tenant_id=TENANT, workflow_id=GRAPH)
        for _ in range(60):  # the learner embeds the finished threads (a second or two)
            lessons = await saver.client.retrieve("research heat pump installers", scope)
            if len(lessons.workflow_outcomes) >= 2:
                break
            await asyncio.sleep(0.5)
        print("\nwhat ALMA learned for the next thread:\n" + lessons.to_prompt())


if __name__ == "__main__":
    asyncio.run(main())
