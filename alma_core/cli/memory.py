"""``alma retrieve`` (what ALMA Stream knows about a task, in a scope) and
``alma db prune`` (retention of old runs' checkpoints)."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from alma_core import scopes
from alma_core.cli import common
from alma_core.memory import MemorySlice, WorkflowOutcome
from alma_core.storage.postgres import connect
from alma_core.storage.retrieval import Retriever
from alma_core.types import RetrievalScope, WorkflowContext


def register(app: typer.Typer) -> None:
    app.command("retrieve")(retrieve)


def retrieve(
    task: str = typer.Argument(..., help="What the agent is about to do."),
    tenant: str = typer.Option(
        None,
        help="Tenant; default ALMA_TENANT (one of them is required unless "
        "ALMA_REQUIRE_TENANT=false).",
    ),
    workflow: str = typer.Option(None, help="Workflow id (WORKFLOW scope, outcomes)."),
    run: str = typer.Option(None, help="Run id (RUN and NODE scopes)."),
    node: str = typer.Option(None, help="Node id (NODE scope)."),
    agent: str = typer.Option(None, help="Agent (AGENT scope)."),
    scope: RetrievalScope = typer.Option(RetrievalScope.WORKFLOW, case_sensitive=False),
    top_k: int = typer.Option(5, "--top-k", min=1, max=100, help="Items per kind."),
    max_tokens: int = typer.Option(800, help="Budget of the prompt shown."),
    as_json: bool = common.json_option("the memories and the prompt"),
) -> None:
    """Memories relevant to TASK in a scope, best first, and the prompt they make."""
    s = common.settings()
    who = common.tenant(s, tenant)

    async def main() -> MemorySlice:
        from alma_core.storage.embeddings import embedder_for

        ctx = WorkflowContext(who, workflow, None, run, node)
        # a context the scope cannot use is refused before the model loads (seconds)
        scopes.memory_filter(ctx, scope, agent=agent, require_tenant=s.require_tenant)
        served = common.embed_url(s)
        where = s.model_copy(update={"embed_url": served})

        def fallback(why: str) -> None:
            common.err.print(f"[yellow]note:[/yellow] {why}")

        with common.err.status(
            f"embedding the task at {served}..." if served else "loading the embedding model..."
        ):
            embedder = embedder_for(where, on_fallback=fallback)
        try:
            async with connect(common.dsn(s), max_size=s.retrieval_fanout + 1) as pool:
                retriever = Retriever.configured(pool, embedder, s)
                return await retriever.retrieve(task, ctx, scope, agent=agent, top_k=top_k)
        finally:
            embedder.close()

    found = common.run(main)
    if as_json:
        common.out.print_json(json.dumps(found.to_doc(max_tokens)))
        return
    table = Table(
        title=f"{len(found.items())} memories for {task!r} "
        f"({scope.value} scope, {found.plan} search, {found.retrieval_time_ms:.1f} ms)"
    )
    for column in ("score", "kind", "scope", "memory"):
        table.add_column(column)
    for item in found.items():
        if isinstance(item, WorkflowOutcome):
            kind, where = "workflow_outcome", f"{item.workflow_id}/{item.run_id}"
            text = item.description
        else:
            kind = item.kind.value
            where = "/".join(x for x in (item.workflow_id, item.run_id, item.node_id) if x)
            text = item.content
        table.add_row(f"{item.score:.3f}", kind, where or "-", text)
    common.out.print(table)
    if found.empty:
        common.out.print(
            "nothing learned in this scope yet: runs are learned from once their "
            "workflow.completed arrives (the learner must be running)"
        )
    else:
        common.out.print(found.to_prompt(max_tokens=max_tokens), markup=False)
