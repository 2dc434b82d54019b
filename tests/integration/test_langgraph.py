"""ALMA Stream driven by LangGraph: AlmaSaver as a graph's checkpointer, the real
broker, PostgreSQL and Redis behind it, the checkpointer applying the writes.

What must hold: LangGraph's own conformance suite for checkpoint savers passes, base
and extended capabilities; a real graph (fan-out with Send, a reducer, an interrupt)
runs, resumes and lists its history as it does on LangGraph's Postgres saver; a
process killed mid-graph resumes from its last checkpoint; a finished thread's outcome
is learned; and what the pipeline refuses raises at the write, never hangs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import Capability
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from alma_core.integrations.langgraph import AlmaSaver
from alma_core.integrations.langgraph.saver import Wait
from alma_core.sdk.client import AlmaClient
from alma_core.settings import Settings
from tests.integration.harness import Worker


@pytest.mark.parametrize("wait", ["applied", "published"])
async def test_langgraph_conformance_suite_passes(
    settings: Settings, worker: Worker, wait: Wait
) -> None:
    """LangGraph's own suite for savers, every capability; with ``wait="published"``
    the saver's reads wait for its writes, so the suite sees the same."""
    async with AlmaClient(settings) as client:

        @checkpointer_test(name=f"AlmaSaver-{wait}")
        async def saver() -> AsyncIterator[AlmaSaver]:
            yield AlmaSaver(client, tenant_id="acme", workflow_id="conformance", wait=wait)

        report = await validate(saver, progress=ProgressCallbacks.verbose())
    failures = {
        name: result.failures for name, result in report.results.items() if not result.passed
    }
    assert failures == {}
    # every capability, base and extended, was detected and ran its tests
    ran = {name: (r.detected, r.tests_passed) for name, r in report.results.items()}
    assert all(detected and passed > 0 for detected, passed in ran.values()), ran
    assert set(ran) == {c.value for c in Capability}
    assert report.passed_all_base()
