"""`alma mcp`: the tools over stdio with the MCP client library, on the real stack."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from alma_core.settings import Settings
from alma_core.storage.embeddings import AsyncEmbedder
from tests.integration.harness import Worker, count, wait_for
from tests.integration.test_cli_runs import env_of
from tests.services import without_alma_settings

TOOLS = {
    "alma_checkpoint",
    "alma_get_resume_point",
    "alma_merge_states",
    "alma_learn_workflow",
    "alma_retrieve",
    "alma_state_at",
    "alma_diff",
    "alma_explain_merge",
    "alma_fork",
}
RUN = {"tenant_id": "acme", "workflow_id": "agent-flow", "run_id": "mcp-run"}


def result_of(result: Any) -> Any:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        return result.structured_content.get("result", result.structured_content)
    return json.loads(result.content[0].text)


def error_of(result: Any) -> str:
    assert result.is_error
    return str(result.content[0].text)


@pytest.mark.slow
async def test_mcp_tools_over_stdio(
    settings: Settings, embedder: AsyncEmbedder, tmp_path: Any
) -> None:
    dsn = settings.postgres_dsn
    assert dsn
    clean = without_alma_settings()
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "alma_core.cli", "mcp"],
        env={**clean, **env_of(settings), "ALMA_DATA_DIR": str(tmp_path)},
    )
    async with (
        Worker.start(settings, ("checkpointer", "joiner", "learner"), embedder),
        Client(server, read_timeout_seconds=120) as client,
    ):
        tools = await client.list_tools()
        assert {t.name for t in tools.tools} == TOOLS
        plan = {**RUN, "node_id": "plan", "state": {"steps": ["a", "b"]}}
        first = result_of(await client.call_tool("alma_checkpoint", plan))
        assert first["effect"] == "checkpointed"
        second = result_of(
            await client.call_tool(
                "alma_checkpoint", {**RUN, "node_id": "act", "updates": {"done": 1}}
            )
        )
        assert second["seq"] == 2
        point = result_of(await client.call_tool("alma_get_resume_point", RUN))
        assert point["latest"]["seq"] == 2
        assert point["state"] == {"steps": ["a", "b"], "done": 1}
        merged = result_of(
            await client.call_tool(
                "alma_merge_states",
                {
                    **RUN,
                    "states": [{"n": 1, "tags": ["x"]}, {"n": 2, "tags": ["y"]}],
                    "reducers": {"n": "sum", "tags": "append"},
                },
            )
        )
        assert merged["status"] == "ok"
        assert merged["merged_state"] == {"n": 3, "tags": ["x", "y"]}
        assert merged["checkpoint_seq"] == 3
        # the run's past: a moment, a diff, a fork (asked twice: one fork)
        past = {"tenant_id": "acme", "run_id": "mcp-run"}
        at1 = result_of(await client.call_tool("alma_state_at", {**past, "seq": 1}))
        assert (at1["seq"], at1["state"]) == (1, {"steps": ["a", "b"]})
        why = result_of(await client.call_tool("alma_explain_merge", {**past, "seq": 3}))
        assert why["inputs"] == ["states[0]", "states[1]"]
        assert {f["field"]: (f["reducer"], f["inputs"], f["result"]) for f in why["fields"]} == {
            "n": ("sum", {"states[0]": 1, "states[1]": 2}, 3),
            "tags": ("append", {"states[0]": ["x"], "states[1]": ["y"]}, ["x", "y"]),
        }
        changed = result_of(await client.call_tool("alma_diff", {**past, "a": 1, "b": 2}))
        assert changed["changes"] == [{"path": "/done", "kind": "added", "after": 1}]
        ask = {**past, "seq": 2, "new_run_id": "mcp-fork"}
        fork = result_of(await client.call_tool("alma_fork", ask))
        assert fork["seq"] == 1
        assert result_of(await client.call_tool("alma_fork", ask)) == fork
        forked = {"tenant_id": "acme", "workflow_id": "agent-flow", "run_id": "mcp-fork"}
        point = result_of(await client.call_tool("alma_get_resume_point", forked))
        assert point["state"] == {"steps": ["a", "b"], "done": 1}
        learned = result_of(
            await client.call_tool(
                "alma_learn_workflow",
                {
                    **RUN,
                    "success": False,
                    "duration_ms": 900,
                    "node_count": 2,
                    "nodes_succeeded": 1,
                    "nodes_failed": 1,
                    "error_message": "tool quota exceeded",
                    "task": "book a flight",
                },
            )
        )
        assert learned["effect"] == "handed_off"

        async def stored() -> bool:
            return await count(dsn, "SELECT count(*) FROM workflow_outcomes") == 1

        await wait_for(stored, limit_s=60, what="the outcome")
        found = result_of(
            await client.call_tool(
                "alma_retrieve",
                {
                    "task": "book a flight",
                    "tenant_id": "acme",
                    "workflow_id": "agent-flow",
                    "scope": "workflow",
                },
            )
        )
        assert found["scope"] == "workflow"
        assert any("tool quota exceeded" in (i.get("description") or "") for i in found["items"])
        assert "tool quota exceeded" in found["prompt"]
        # bad input: a clear tool error, and the server keeps serving
        assert "no run 'nope' of tenant" in error_of(
            await client.call_tool("alma_get_resume_point", {**RUN, "run_id": "nope"})
        )
        assert "unknown scope" in error_of(
            await client.call_tool(
                "alma_retrieve", {"task": "x", "tenant_id": "acme", "scope": "galaxy"}
            )
        )
        assert "StaleExpectedSeq" in error_of(
            await client.call_tool(
                "alma_checkpoint",
                {
                    **RUN,
                    "run_id": "mcp-other",
                    "node_id": "n",
                    "updates": {"x": 1},
                    "expected_seq": 1,
                },
            )
        )
        # the run is completed (alma_learn_workflow): it takes no more checkpoints
        assert "RunCompleted" in error_of(
            await client.call_tool(
                "alma_checkpoint", {**RUN, "node_id": "late", "updates": {"x": 1}}
            )
        )
        assert "exactly one of" in error_of(
            await client.call_tool("alma_checkpoint", {**RUN, "node_id": "both"})
        )
