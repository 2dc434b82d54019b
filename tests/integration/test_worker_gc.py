"""`alma worker`, once its consumers are ready, puts what is alive out of the garbage
collector's sight (``ALMA_GC_FREEZE``, on by default), and times the collector's pauses
on /metrics either way."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from alma_core.cli.embedded import free_port
from alma_core.settings import Settings
from tests.integration.harness import WorkerProcess, wait_for
from tests.integration.test_http import get


def log_events(worker: WorkerProcess, action: str) -> list[dict[str, Any]]:
    out = []
    for line in worker.log_since_start().splitlines():
        if line.startswith("{") and f'"{action}"' in line:
            out.append(json.loads(line))
    return out


@pytest.mark.parametrize("freeze", [True, False])
async def test_a_worker_freezes_its_start_up_objects_once_ready(
    settings: Settings, tmp_path: Path, freeze: bool
) -> None:
    port = free_port()
    s = settings.model_copy(update={"gc_freeze": freeze, "metrics_port": port})
    worker = WorkerProcess(s, tmp_path / "worker.log").start()
    try:

        async def ready() -> bool:
            try:
                return (await get(port, "/readyz"))[0] == 200
            except OSError:
                return False

        await wait_for(ready, what="the worker to be ready")

        async def frozen() -> list[dict[str, Any]]:
            return log_events(worker, "heap_frozen")

        if freeze:
            events = await wait_for(frozen, limit_s=20, what="the start-up objects frozen")
            assert len(events) == 1
            assert events[0]["objects"] > 10_000  # modules, pools, clients
        else:
            await asyncio.sleep(2)  # when on, the freeze follows readiness at once
            assert await frozen() == []
        _, text = await get(port, "/metrics")
        counts = {
            ln.split(" ")[0]: float(ln.split(" ")[1])
            for ln in text.splitlines()
            if ln.startswith("alma_gc_pause_seconds_count")
        }
        assert counts['alma_gc_pause_seconds_count{generation="0"}'] > 0
    finally:
        assert worker.terminate() == 0
