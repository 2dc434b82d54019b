"""The same LangGraph graph on AlmaSaver and on LangGraph's AsyncPostgresSaver, side by
side in one run, on one PostgreSQL server (the peer in its own database).

The graph: 10 nodes (``start → prep → plan → branch ×5 by Send → merge → post1..post5``),
each node rewriting a 5 KB field (a branch adding 1 KB to a list) and appending a note
(both lists ``Annotated[list, add]``).

* Invokes: one thread at a time, and 20 threads at once; invokes per second and each
  invoke's p50/p99, per durability mode (``sync``, ``async``, ``exit``); AlmaSaver with
  ``wait="applied"`` (a write returns once the checkpointer applied it) and
  ``wait="published"`` (once the broker has it; the saver's reads wait for it).
* Storage per checkpoint: the tables' size (with indexes and TOAST) over the
  checkpoints stored; ALMA's includes the audit log's rows of the thread's events.
* ``aget_tuple`` of a thread's latest checkpoint at 10 and 10,000 checkpoints.
* A chat whose history is a LangGraph 1.2 ``DeltaChannel`` (:mod:`bench.langgraph_chat`,
  LangGraph's default snapshot every 100 updates): each turn's time over a long thread
  (a turn rebuilds the history from the last snapshot and the writes since), and
  ``aget_state_history`` over the whole thread.

The checkpointer runs in this process, on the same 2 cores as the graph.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import random
import string
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypedDict

import asyncpg
from langgraph.checkpoint.base import BaseCheckpointSaver, empty_checkpoint
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from alma_core.integrations.langgraph import AlmaSaver
from alma_core.sdk.client import AlmaClient
from bench import langgraph_chat as chat
from bench.env import Env, alma_workers
from bench.peers import langgraph_saver_pool
from bench.report import Section, Stat, pct, ratio

DURABILITY = ("sync", "async", "exit")
SAVERS = ("AsyncPostgresSaver", "AlmaSaver, wait=applied", "AlmaSaver, wait=published")
FIELD = 5 * 1024
READ_SIZES = (10, 10_000)
CHAT_TURNS = 200  # the delta-channel chat's turns (quick: 40)
CHAT_SNAPSHOT_EVERY = 100  # LangGraph's default snapshot_frequency


class State(TypedDict, total=False):
    scratch: str
    parts: Annotated[list[str], operator.add]  # the branches' (1 KB each)
    notes: Annotated[list[str], operator.add]


def _text(size: int = FIELD) -> str:
    return "".join(random.choices(string.ascii_letters, k=size))


def build(saver: BaseCheckpointSaver[Any]) -> Any:
    def node(name: str) -> Any:
        def run(state: State) -> State:
            if name == "branch":  # five at once: each adds a part
                return {"parts": [_text(FIELD // 5)], "notes": [name]}
            return {"scratch": _text(), "notes": [name]}

        return run

    graph = StateGraph(State)
    chain = ["start", "prep", "plan", "branch", "merge"] + [f"post{i}" for i in range(1, 6)]
    for name in chain:
        graph.add_node(name, node(name))
    graph.add_edge(START, "start")
    graph.add_edge("start", "prep")
    graph.add_edge("prep", "plan")
    graph.add_conditional_edges("plan", lambda s: [Send("branch", s) for _ in range(5)], ["branch"])
    graph.add_edge("branch", "merge")
    for a, b in itertools.pairwise(chain[4:]):
        graph.add_edge(a, b)
    graph.add_edge(chain[-1], END)
    return graph.compile(checkpointer=saver)


async def invokes(
    graph: Any, durability: str, threads: int, rounds: int
) -> tuple[list[float], float]:
    """Each invoke's seconds and invokes per second: ``threads`` threads at once,
    ``rounds`` times (a new thread each invoke)."""
    seconds: list[float] = []

    async def one() -> None:
        config = {"configurable": {"thread_id": f"b-{uuid.uuid4().hex[:12]}"}}
        started = time.perf_counter()
        await graph.ainvoke({"scratch": _text()}, config, durability=durability)
        seconds.append(time.perf_counter() - started)

    started = time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(one() for _ in range(threads)))
    return seconds, threads * rounds / (time.perf_counter() - started)


@asynccontextmanager
async def savers(env: Env, pool: Any) -> AsyncIterator[dict[str, BaseCheckpointSaver[Any]]]:
    topic = await env.topic("langgraph")
    async with alma_workers(env, topic) as s, AlmaClient(s) as client:
        yield {
            SAVERS[0]: AsyncPostgresSaver(pool),
            SAVERS[1]: AlmaSaver(client, tenant_id="bench", workflow_id="bench-graph"),
            SAVERS[2]: AlmaSaver(
                client, tenant_id="bench", workflow_id="bench-graph", wait="published"
            ),
        }


ALMA_TABLES = ("graph_checkpoints", "graph_blobs", "graph_writes", "run_events")
PEER_TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")
STORED_INVOKES = 20  # the graph's invokes whose storage is measured, per saver and repetition


async def stored_bytes(
    saver: BaseCheckpointSaver[Any], dsn: str, tables: tuple[str, ...], invokes_: int
) -> float:
    """Bytes per checkpoint the saver's tables grow by (indexes and TOAST included) for
    ``invokes_`` invokes of the bench graph (``sync``; an AlmaSaver that waits as
    ``applied``): what those add, whatever the tables held before (other sections'
    rows, filler). ALMA's tables include its audit log (``run_events``)."""
    conn = await asyncpg.connect(dsn)
    try:

        async def sizes() -> tuple[int, int]:
            total = sum(
                [await conn.fetchval("SELECT pg_total_relation_size($1)", t) for t in tables]
            )
            return total, await conn.fetchval(f"SELECT count(*) FROM {tables[0]}")

        before, count_before = await sizes()
        await invokes(build(saver), "sync", 1, invokes_)
        after, count_after = await sizes()
    finally:
        await conn.close()
    return (after - before) / max(1, count_after - count_before)


async def _long_thread(saver: BaseCheckpointSaver[Any], thread: str, n: int) -> Any:
    """A thread of ``n`` checkpoints (each a 5 KB field), written with ``aput``."""
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    version: Any = None
    for step in range(n):
        checkpoint = empty_checkpoint()
        version = saver.get_next_version(version, None)
        checkpoint["channel_values"] = {"scratch": _text()}
        checkpoint["channel_versions"] = {"scratch": version}
        config = await saver.aput(
            config, checkpoint, {"source": "loop", "step": step}, {"scratch": version}
        )
    await saver.aget_tuple(config)  # a published saver's writes, applied
    return config


async def reads(saver: BaseCheckpointSaver[Any], n: int, samples: int) -> list[float]:
    config = await _long_thread(saver, f"r-{uuid.uuid4().hex[:10]}", n)
    latest = {"configurable": {**config["configurable"]}}
    del latest["configurable"]["checkpoint_id"]
    seconds = []
    for _ in range(samples):
        started = time.perf_counter()
        found = await saver.aget_tuple(latest)
        seconds.append(time.perf_counter() - started)
        if found is None or found.checkpoint["id"] != config["configurable"]["checkpoint_id"]:
            raise RuntimeError(f"{type(saver).__name__} read a wrong latest checkpoint: {found}")
    return seconds


async def chat_thread(saver: BaseCheckpointSaver[Any], turns: int) -> tuple[list[float], float]:
    """Each turn's seconds over one chat thread of ``turns`` turns, and the seconds of
    ``aget_state_history`` over the whole thread (every state rebuilt)."""
    graph = chat.build(saver, CHAT_SNAPSHOT_EVERY)
    thread, seconds = f"c-{uuid.uuid4().hex[:12]}", []
    for i in range(turns):
        started = time.perf_counter()
        await graph.ainvoke({"messages": [f"user {i}"]}, chat.turn(thread))
        seconds.append(time.perf_counter() - started)
    started = time.perf_counter()
    states = [s async for s in graph.aget_state_history(chat.turn(thread))]
    history_s = time.perf_counter() - started
    if len(states) != 3 * turns or len(states[0].values["messages"]) != 2 * turns:
        raise RuntimeError(f"{type(saver).__name__} lost states or messages of a chat thread")
    return seconds, history_s


async def run(env: Env, section: Section) -> None:
    section.table(
        "langgraph",
        "The same LangGraph graph (10 nodes, a 5-way Send fan-out, 5 KB per node) on each saver",
        ["saver", "durability", "threads", "invokes/s", "p50 ms", "p99 ms", "× AsyncPostgresSaver"],
    )
    section.table(
        "langgraph_reads",
        "LangGraph `aget_tuple` of a thread's latest checkpoint, and storage per checkpoint",
        ["saver", "checkpoints in the thread", "p50 ms", "p99 ms", "bytes per checkpoint"],
    )
    section.table(
        "langgraph_delta",
        f"A chat whose history is a `DeltaChannel` (snapshot every {CHAT_SNAPSHOT_EVERY} "
        "updates): one thread, turn after turn",
        ["saver", "turns", "turn p50 ms", "turn p99 ms", "history s", "turn p50 × reference"],
    )
    turns = 40 if env.quick else CHAT_TURNS
    chats: dict[str, list[tuple[list[float], float]]] = {}
    # 20 threads at once: issue 40's measure of the saver against the reference
    sequential, concurrent, rounds = (5, 20, 1) if env.quick else (20, 20, 5)
    stored = STORED_INVOKES // 4 if env.quick else STORED_INVOKES
    sizes: dict[str, list[float]] = {}
    samples = 50 if env.quick else 200
    got: dict[tuple[str, str, int], list[tuple[list[float], float]]] = {}
    read_got: dict[tuple[str, int], list[list[float]]] = {}
    pool = await langgraph_saver_pool(env.peer_dsn, size=20)
    try:
        for _ in range(env.reps):
            async with savers(env, pool) as by_name:
                for durability in DURABILITY:
                    for name, saver in by_name.items():
                        graph = build(saver)
                        await invokes(graph, durability, 1, 1)  # warm
                        for threads, n in ((1, sequential), (concurrent, rounds)):
                            env.step(f"LangGraph: {name}, {durability}, {threads} threads")
                            result = await _timed(graph, durability, threads, n)
                            got.setdefault((name, durability, threads), []).append(result)
                        env.done()
                for name in (SAVERS[0], SAVERS[2]):
                    for n in READ_SIZES:
                        env.step(f"LangGraph reads: {name}, {n:,} checkpoints")
                        seconds = await reads(by_name[name], n, samples)
                        read_got.setdefault((name.split(",")[0], n), []).append(seconds)
                    env.done()
                env.step(f"LangGraph delta-channel chat, {turns} turns, each saver")
                for name, saver in by_name.items():
                    chats.setdefault(name, []).append(await chat_thread(saver, turns))
                env.done()
                env.step("LangGraph storage per checkpoint, both savers")
                for name, dsn, tables in (
                    (SAVERS[0], env.peer_dsn, PEER_TABLES),
                    (SAVERS[1], env.services.postgres_dsn, ALMA_TABLES),
                ):
                    size = await stored_bytes(by_name[name], dsn, tables, stored)
                    sizes.setdefault(name.split(",")[0], []).append(size)
                env.done()
    finally:
        await pool.close()
    for durability in DURABILITY:
        for threads in (1, concurrent):
            base = Stat([r for _, r in got[(SAVERS[0], durability, threads)]], 1)
            for name in SAVERS:
                runs = got[(name, durability, threads)]
                rate = Stat([r for _, r in runs], 1)
                section.add(
                    "langgraph",
                    [
                        name,
                        durability,
                        threads,
                        rate,
                        Stat([pct(s, 50) * 1000 for s, _ in runs], 1),
                        Stat([pct(s, 99) * 1000 for s, _ in runs], 1),
                        ratio(rate, base),
                    ],
                )
    for name in ("AsyncPostgresSaver", "AlmaSaver"):
        for n in READ_SIZES:
            runs_ = read_got[(name, n)]
            section.add(
                "langgraph_reads",
                [
                    name,
                    f"{n:,}",
                    Stat([pct(s, 50) * 1000 for s in runs_]),
                    Stat([pct(s, 99) * 1000 for s in runs_]),
                    Stat(sizes[name], 0),
                ],
            )
    base_turn = Stat([pct(s, 50) * 1000 for s, _ in chats[SAVERS[0]]])
    for name in SAVERS:
        turn_p50 = Stat([pct(s, 50) * 1000 for s, _ in chats[name]])
        section.add(
            "langgraph_delta",
            [
                name,
                turns,
                turn_p50,
                Stat([pct(s, 99) * 1000 for s, _ in chats[name]]),
                Stat([h for _, h in chats[name]], 2),
                ratio(turn_p50, base_turn),
            ],
        )
    section.note(
        "langgraph_delta",
        f"{turns} turns of one thread (3 checkpoints a turn, two updates of `messages`); a "
        "turn reads the thread's latest state, which LangGraph rebuilds from the last "
        "snapshot and the writes since (AlmaSaver: one query, `aget_delta_channel_history`"
        "); history: `aget_state_history` of the whole thread, every state rebuilt.",
    )
    section.note(
        "langgraph",
        f"{sequential} invokes one after another (threads = 1), or {concurrent} at once "
        f"{rounds}× (each invoke its own thread); an invoke writes 11 checkpoints and 15 "
        "tasks' writes (`exit`: one checkpoint at the end). The checkpointer, the graph "
        "and PostgreSQL share 2 cores; ALMA_FETCH_MAX_WAIT_MS=50.",
    )
    section.note(
        "langgraph_reads",
        f"{samples} reads of the latest checkpoint (5 KB value) of a thread of that many "
        "checkpoints written by `aput`; AlmaSaver's reads are PostgreSQL's (one indexed "
        "query), the same for both wait modes. Storage: what each saver's tables (indexes "
        f"and TOAST included) grow by over {stored} invokes of the graph (`sync`), per "
        "checkpoint; ALMA's tables include its audit log of the threads' events. What "
        "the tables say, from this run:",
    )
    for line in findings(got, read_got, sizes, concurrent):
        section.note("langgraph_reads", line)


def findings(
    got: dict[tuple[str, str, int], list[tuple[list[float], float]]],
    read_got: dict[tuple[str, int], list[list[float]]],
    sizes: dict[str, list[float]],
    concurrent: int,
) -> list[str]:
    """The prose under the tables, its every number from this run's."""

    def rate(name: str, durability: str, threads: int) -> Stat:
        return Stat([r for _, r in got[(name, durability, threads)]])

    def against(name: str, threads: int) -> dict[str, float]:
        return {
            d: ratio(rate(name, d, threads), rate(SAVERS[0], d, threads)).median for d in DURABILITY
        }

    def each(ratios: dict[str, float]) -> str:
        return ", ".join(f"{r:.2f}× `{d}`" for d, r in ratios.items())

    published, applied1 = against(SAVERS[2], concurrent), against(SAVERS[1], 1)
    applied = against(SAVERS[1], concurrent)
    ahead = [d for d, r in published.items() if r >= 1]
    reads = {
        n: Stat([pct(s, 50) for s in read_got[("AlmaSaver", n)]]).median
        / Stat([pct(s, 50) for s in read_got[("AsyncPostgresSaver", n)]]).median
        for n in READ_SIZES
    }
    ours, theirs = Stat(sizes["AlmaSaver"]).median, Stat(sizes["AsyncPostgresSaver"]).median
    return [
        f'- `wait="published"` at {concurrent} threads, invokes/s against '
        f"AsyncPostgresSaver: {each(published)} (ahead in "
        f"{', '.join(f'`{d}`' for d in ahead) or 'no mode'}; issue 40's target, ≥ 1.0× "
        f"in every mode: {'met' if len(ahead) == len(published) else 'missed'}).",
        f'- `wait="applied"` waits a broker round trip per write: {each(applied1)} one '
        f"thread at a time; {each(applied)} at {concurrent} threads.",
        "- `aget_tuple` p50 against the reference: "
        + ", ".join(f"{r:.2f}× at {n:,} checkpoints" for n, r in reads.items())
        + ".",
        f"- Storage: {ours:,.0f} bytes per checkpoint against {theirs:,.0f}, "
        f"{ours / theirs:.2f}× (audit log included).",
    ]


async def _timed(graph: Any, durability: str, threads: int, n: int) -> tuple[list[float], float]:
    """``n`` invokes one after another (one thread), or ``n`` rounds of ``threads``."""
    if threads == 1:
        seconds: list[float] = []
        started = time.perf_counter()
        for _ in range(n):
            one, _ = await invokes(graph, durability, 1, 1)
            seconds += one
        return seconds, n / (time.perf_counter() - started)
    return await invokes(graph, durability, threads, n)


STEPS_PER_REP = len(DURABILITY) * len(SAVERS) + 2 + 1 + 1  # invokes, reads, chat, storage
