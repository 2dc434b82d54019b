"""Retrieval quality on a labelled set: does the right past run come back first?

The set (written for this benchmark, kept in this file): 20 finished runs of two
tenants, with task texts, node paths, failures with their error messages, and
near-duplicate tasks across tenants (one tenant's failure is another's success);
22 questions phrased differently from the tasks, each with the one past run that
answers it. The runs go through the real pipeline (lifecycle events on Kafka, the
checkpointer, the learner with the real embedding model); each question is asked in
its tenant's scope with ``top_k=5`` and the rank of the expected run among the
workflow outcomes is read, under three rankings:

* ALMA's (the default: relevance first, recency and confidence within a band);
* cosine similarity alone (``tie_band=0``);
* the seed's weighted sum (``ranking="weighted"``), the former default.

Reported: hit@1, hit@5, MRR, and items of another tenant (must be 0).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer

from alma_core.consumers.worker import run_worker
from alma_core.scoring import ScoringWeights
from alma_core.storage.embeddings import AsyncEmbedder, load_embedder
from alma_core.storage.postgres import connect
from alma_core.storage.retrieval import Retriever
from alma_core.types import RetrievalScope, WorkflowContext
from bench.env import CODEC, Env
from bench.report import Section


@dataclass(frozen=True)
class PastRun:
    key: str
    tenant: str
    workflow: str
    task: str
    nodes: tuple[str, ...]
    failed_at: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Question:
    tenant: str
    text: str
    expected: str  # the PastRun key that answers it


RUNS = [
    PastRun(
        "inv-eu",
        "acme",
        "invoicing",
        "Generate the monthly invoices for European customers and convert totals to EUR",
        ("load", "price", "fx_convert", "render"),
    ),
    PastRun(
        "inv-fx-down",
        "acme",
        "invoicing",
        "Generate the quarterly invoices for Swiss customers in CHF",
        ("load", "price", "fx_convert"),
        "fx_convert",
        "HTTP 503 Service Unavailable from the exchange-rate service",
    ),
    PastRun(
        "remind",
        "acme",
        "invoicing",
        "Send payment reminders for invoices overdue by more than 30 days",
        ("select", "compose", "email"),
    ),
    PastRun(
        "reconcile",
        "acme",
        "invoicing",
        "Reconcile bank statement lines with open invoices",
        ("load", "match"),
        "match",
        "ambiguous match: 2 open invoices have the amount 120.00",
    ),
    PastRun(
        "papers-graph",
        "acme",
        "research",
        "Summarise recent papers on graph databases",
        ("search", "read", "summarise"),
    ),
    PastRun(
        "heatpumps",
        "acme",
        "research",
        "Collect prices of heat pump installers in Berlin",
        ("search", "scrape"),
        "scrape",
        "robots.txt disallows crawling the installer directory",
    ),
    PastRun(
        "manual-de",
        "acme",
        "research",
        "Translate the product manual into German",
        ("split", "translate", "merge"),
    ),
    PastRun(
        "pdf-tables",
        "acme",
        "research",
        "Extract tables from scanned PDF annual reports",
        ("fetch", "ocr"),
        "ocr",
        "OCR engine timed out after 120 s on page 14",
    ),
    PastRun(
        "lisbon",
        "acme",
        "travel",
        "Book travel for the sales conference in Lisbon",
        ("flights", "hotel", "confirm"),
    ),
    PastRun(
        "offsite",
        "acme",
        "travel",
        "Book flights and hotel for the engineering offsite in Porto",
        ("flights",),
        "flights",
        "fare expired before the booking could complete",
    ),
    PastRun(
        "tickets-urgency",
        "acme",
        "support",
        "Classify support tickets by urgency",
        ("load", "classify", "route"),
    ),
    PastRun(
        "tickets-area",
        "acme",
        "support",
        "Classify support tickets by product area",
        ("load", "classify"),
        "classify",
        "context length exceeded: 9000 tokens for a 8192-token model",
    ),
    PastRun(
        "churn",
        "acme",
        "analytics",
        "Build a churn report for the enterprise accounts",
        ("query", "chart", "publish"),
    ),
    PastRun(
        "dashboard",
        "acme",
        "analytics",
        "Refresh the revenue dashboard from the warehouse",
        ("query",),
        "query",
        "permission denied for table finance.revenue",
    ),
    PastRun(
        "g-inv-us",
        "globex",
        "invoicing",
        "Generate the monthly invoices for US customers in USD",
        ("load", "price", "render"),
    ),
    PastRun(
        "g-papers",
        "globex",
        "research",
        "Summarise recent papers on vector databases",
        ("search", "read", "summarise"),
    ),
    PastRun(
        "g-pdf-tables",
        "globex",
        "research",
        "Extract tables from scanned PDF annual reports",
        ("fetch", "ocr", "export"),
    ),
    PastRun(
        "g-remind",
        "globex",
        "invoicing",
        "Send payment reminders for overdue invoices",
        ("select", "compose", "email"),
        "email",
        "SMTP 550 mailbox unavailable",
    ),
    PastRun(
        "g-offsite",
        "globex",
        "travel",
        "Book flights and hotel for the engineering offsite in Porto",
        ("flights", "hotel", "confirm"),
    ),
    PastRun(
        "g-tickets",
        "globex",
        "support",
        "Classify support tickets by product area",
        ("load", "classify", "route"),
    ),
]

QUESTIONS = [
    Question("acme", "bill our EU clients for the month, with amounts in euros", "inv-eu"),
    Question(
        "acme",
        "the currency conversion API was unavailable while invoicing in Swiss francs",
        "inv-fx-down",
    ),
    Question("acme", "invoice Swiss customers for the quarter", "inv-fx-down"),
    Question("acme", "email customers who have not paid after a month", "remind"),
    Question("acme", "match bank transactions to unpaid invoices", "reconcile"),
    Question(
        "acme", "two invoices with the same amount made the bank matching ambiguous", "reconcile"
    ),
    Question("acme", "write a summary of the latest graph database research", "papers-graph"),
    Question("acme", "gather what heat pump installers charge in Berlin", "heatpumps"),
    Question("acme", "the scraper was blocked by robots.txt", "heatpumps"),
    Question("acme", "translate the user guide to German", "manual-de"),
    Question("acme", "pull the tables out of scanned annual report PDFs", "pdf-tables"),
    Question("acme", "text recognition timed out on a long scanned report", "pdf-tables"),
    Question("acme", "arrange flights and a hotel for the Lisbon sales event", "lisbon"),
    Question("acme", "book the team's trip to the Porto offsite", "offsite"),
    Question("acme", "sort incoming support requests by how urgent they are", "tickets-urgency"),
    Question("acme", "tag support tickets with the product they concern", "tickets-area"),
    Question("acme", "which enterprise customers are likely to cancel", "churn"),
    Question("acme", "update the revenue dashboard", "dashboard"),
    Question("globex", "bill our American customers for the month in dollars", "g-inv-us"),
    Question("globex", "pull the tables out of scanned annual report PDFs", "g-pdf-tables"),
    Question("globex", "remind customers with late invoices by email", "g-remind"),
    Question("globex", "book the team's trip to the Porto offsite", "g-offsite"),
]

RANKINGS = {
    "ALMA (relevance first)": ScoringWeights(),
    "cosine similarity alone": ScoringWeights(tie_band=0),
    "seed's weighted sum (former default)": ScoringWeights(ranking="weighted"),
}


def events(run: PastRun, run_id: str) -> list[dict[str, Any]]:
    """The run's lifecycle events as an orchestrator publishes them."""
    now = datetime.now(UTC).isoformat()
    base = {"tenant_id": run.tenant, "workflow_id": run.workflow, "run_id": run_id}
    docs: list[dict[str, Any]] = []
    for node in run.nodes:
        doc: dict[str, Any] = {**base, "event_id": uuid.uuid4().hex, "emitted_at": now}
        if node == run.failed_at:
            error = {"type": "TaskError", "message": run.error or ""}
            docs.append(
                {**doc, "type": "node.failed", "node_id": node, "payload": {"error": error}}
            )
        else:
            docs.append(
                {
                    **doc,
                    "type": "node.completed",
                    "node_id": node,
                    "payload": {"updates": {node: True}},
                }
            )
    ok = run.failed_at is None
    payload = {
        "outcome": "success" if ok else "failure",
        "duration_ms": 1000,
        "node_count": len(run.nodes),
        "nodes_succeeded": len(run.nodes) - (0 if ok else 1),
        "nodes_failed": 0 if ok else 1,
        "task": run.task,
        "error_message": run.error,
    }
    docs.append(
        {
            **base,
            "event_id": uuid.uuid4().hex,
            "emitted_at": now,
            "type": "workflow.completed",
            "payload": payload,
        }
    )
    return docs


@dataclass
class Scores:
    hit1: int = 0
    hit5: int = 0
    reciprocal: float = 0.0
    foreign: int = 0
    asked: int = 0

    @property
    def mrr(self) -> float:
        return self.reciprocal / self.asked if self.asked else 0.0


async def evaluate(
    pool: asyncpg.Pool, embedder: AsyncEmbedder, run_ids: dict[str, str]
) -> dict[str, Scores]:
    """Ask every question under every ranking; ``run_ids``: PastRun key -> its run id."""
    results: dict[str, Scores] = {}
    for name, weights in RANKINGS.items():
        retriever = Retriever(pool, embedder, weights=weights)
        scores = Scores()
        for q in QUESTIONS:
            found = await retriever.retrieve(
                q.text, WorkflowContext(tenant_id=q.tenant), RetrievalScope.TENANT, top_k=5
            )
            ranked = [o.run_id for o in found.workflow_outcomes]
            scores.foreign += sum(1 for i in found.items() if i.tenant_id != q.tenant)
            scores.asked += 1
            expected = run_ids[q.expected]
            if expected in ranked:
                rank = ranked.index(expected) + 1
                scores.hit1 += rank == 1
                scores.hit5 += 1
                scores.reciprocal += 1 / rank
        results[name] = scores
    return results


def report(section: Section, results: dict[str, Scores]) -> None:
    section.table(
        "quality",
        f"Retrieval quality: {len(QUESTIONS)} questions over {len(RUNS)} past runs of 2 tenants",
        [
            "ranking",
            "right run first (hit@1)",
            "in the top 5 (hit@5)",
            "MRR",
            "other tenants' items",
        ],
    )
    for name, s in results.items():
        section.add(
            "quality",
            [name, f"{s.hit1} / {s.asked}", f"{s.hit5} / {s.asked}", f"{s.mrr:.3f}", s.foreign],
        )
    section.note(
        "quality",
        "Each question in its tenant's scope, top_k=5, the expected run's rank among the "
        "workflow outcomes; the runs went through Kafka, the checkpointer and the learner "
        "with the bundled all-MiniLM-L6-v2.",
    )


STEPS_PER_REP = 3


async def run(env: Env, section: Section) -> None:
    """The set through a checkpointer and a learner in this process (one repetition:
    the figures are counts, the same each time)."""
    topic = await env.topic("quality")
    s = env.settings_for(topic, group_prefix=f"bq{uuid.uuid4().hex[:6]}")
    env.step("quality: loading the embedding model")
    embedder = await asyncio.to_thread(load_embedder, s)
    env.done()
    try:
        run_ids = {r.key: f"{r.key}-{uuid.uuid4().hex[:6]}" for r in RUNS}
        stop, ready = asyncio.Event(), asyncio.Event()
        worker = asyncio.create_task(
            run_worker(
                s, env.services, ["checkpointer", "learner"], stop, ready=ready, embedder=embedder
            )
        )
        await asyncio.wait_for(ready.wait(), 120)
        env.step("quality: the past runs through the pipeline")
        try:
            producer = AIOKafkaProducer(
                bootstrap_servers=env.services.kafka_bootstrap, acks="all", compression_type=CODEC
            )
            await producer.start()
            try:
                for r in RUNS:
                    for doc in events(r, run_ids[r.key]):
                        await producer.send(
                            topic, json.dumps(doc).encode(), key=doc["run_id"].encode()
                        )
                await producer.flush()
            finally:
                await producer.stop()
            async with connect(env.services.postgres_dsn, max_size=2) as pool:
                wanted = list(run_ids.values())
                for _ in range(600):  # at most 120 s
                    n = await pool.fetchval(
                        "SELECT count(*) FROM workflow_outcomes WHERE run_id = ANY($1::text[])",
                        wanted,
                    )
                    if n == len(wanted):
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise RuntimeError(f"only {n} of {len(wanted)} past runs were learned in 120 s")
                env.done()
                env.step("quality: asking the questions")
                results = await evaluate(pool, embedder, run_ids)
                env.done()
        finally:
            stop.set()
            await worker
    finally:
        embedder.close()
    report(section, results)
