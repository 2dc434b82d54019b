"""`python -m bench` runs as the README says, on already-running services (the
session's broker, PostgreSQL and Redis), and what it writes holds together: every
side-by-side table, ALMA's run state losing nothing under concurrent writers, replay
verifying its runs and a fork timed, and a clear refusal of a suite that does not
exist."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from alma_core.settings import Settings
from tests.services import without_alma_settings

ROOT = Path(__file__).resolve().parents[2]


async def spawn(
    services: dict[str, str],
    scratch: Path,
    *args: str,
    output: int = asyncio.subprocess.PIPE,
) -> asyncio.subprocess.Process:
    """``python -m bench ARGS`` with these ``ALMA_*`` services and no others (none:
    it starts its own embedded stack), its temporary files under ``scratch``."""
    env = without_alma_settings()
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench",
        *args,
        cwd=ROOT,
        env=env | services | {"COLUMNS": "200", "TMPDIR": str(scratch)},
        stdout=output,
        stderr=asyncio.subprocess.STDOUT,
    )


async def bench(settings: Settings, scratch: Path, *args: str) -> tuple[int, str]:
    services = {
        "ALMA_KAFKA_BOOTSTRAP": settings.kafka_bootstrap or "",
        "ALMA_POSTGRES_DSN": settings.postgres_dsn or "",
        "ALMA_REDIS_URL": settings.redis_url or "",
    }
    proc = await spawn(services, scratch, *args)
    out, _ = await asyncio.wait_for(proc.communicate(), 280)
    return proc.returncode or 0, out.decode(errors="replace")


@pytest.mark.timeout(420)
@pytest.mark.slow
async def test_quick_side_by_side_run_writes_every_table(
    settings: Settings, tmp_path: Path
) -> None:
    out = tmp_path / "benchmarks.md"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    rc, log = await bench(
        settings,
        scratch,
        "--smoke",
        "--only",
        "peers,replay,ui,tracing,tenants",
        "--out",
        str(out),
    )
    assert rc == 0, log[-3000:]
    assert not list(scratch.iterdir())  # the worker processes' logs went with them
    text = out.read_text()
    assert "<!-- bench:peers:start -->" in text
    assert "<!-- bench:peers:end -->" in text
    doc = json.loads(out.with_suffix(".json").read_text())
    tables = doc["peers"]["tables"]
    assert set(tables) == {
        "writes",
        "write_ratio",
        "ceiling",
        "cpu",
        "codec",
        "capacity",
        "storage",
        "reads",
        "run_state",
        "run_state_ratio",
        "merge",
    }
    assert doc["peers"]["machine"]["services"]["PostgreSQL"]
    # the sentences under the tables read their figures from this run's rows
    ceiling_notes = tables["ceiling"]["notes"]
    assert len(ceiling_notes) == 2
    assert all("target ≥ 0.9×: " in n for n in ceiling_notes)
    assert "target ≥ 3.0×: " in tables["capacity"]["notes"][0]
    merge_note = tables["merge"]["notes"][0]
    merge_ratio = tables["merge"]["rows"][0]["ALMA ÷ LangGraph"]["median"]
    assert f"costs {merge_ratio:.2f}× LangGraph's reducer step" in merge_note
    # replay to verify and a fork (issue 38): every run replayed the same, a fork timed
    replay = {r["what"]: r for r in doc["replay"]["tables"]["replay"]["rows"]}
    assert replay["replay to verify (load, fold, compare)"]["events/s"]["median"] > 0
    assert replay["the fold alone (pure)"]["events/s"]["median"] > 0
    assert replay["a fork (read, publish, applied)"]["p50 ms"]["median"] > 0
    # the run inspector's pages (issue 39): every page answered, each timed
    pages = doc["ui"]["tables"]["ui"]["rows"]
    # lists, searches, paging both ways, four sorts, a run and its history, a checkpoint,
    # a diff, the dead letters, a state of many fields whole, searched and paged
    assert len(pages) == 20
    assert all(p["p95 ms"]["median"] > 0 for p in pages)
    assert {"runs, by duration, a later page", "the same, fields whose name has '99'"} <= {
        p["page"] for p in pages
    }
    # what traces cost (issue 53): off, 1 % and every trace, each drained; spans only when on
    traced = {r["traces"]: r for r in doc["tracing"]["tables"]["tracing"]["rows"]}
    assert set(traced) == {"off", "on, 1 %", "on, 100 %"}
    assert all(r["checkpoints/s"]["median"] > 0 for r in traced.values())
    assert traced["off"]["spans exported"]["median"] == 0
    backlog = 10_000 // 4  # --smoke: --quick's backlog, a quarter of it
    assert traced["on, 100 %"]["spans exported"]["median"] > backlog  # one per event, and more
    # fairness between tenants (issue 50): B timed in each load; A's flood all applied in order
    loads = {r["load"]: r for r in doc["tenants"]["tables"]["tenants"]["rows"]}
    assert len(loads) == 4
    assert all(r["B p99 ms"]["median"] > 0 for r in loads.values())
    # beside each load, what held the checkpointer back: its loop's lateness, the machine's
    assert all(
        0 <= r["checkpointer's loop late, p99 ms"]["median"] <= r["its longest stall, ms"]["max"]
        for r in loads.values()
    )
    assert all(0 < r["machine busy %"]["median"] <= 100 for r in loads.values())
    assert all(0 <= r["machine steal %"]["median"] <= 100 for r in loads.values())
    assert loads["A floods at 10× its quota"]["A: all applied, in order"] == "yes"
    assert loads["A floods, no quota"]["A: all applied, in order"] == "yes"
    assert loads["A floods at 10× its quota"]["A applied during the flood (/s)"]["median"] < 200
    assert "target 1.5×: " in doc["tenants"]["tables"]["tenants"]["notes"][0]
    writes = tables["writes"]["rows"]
    expected = {
        (s, w, system)
        for s in ("5 KB", "100 KB")
        for w in (1, 50)
        for system in ("ALMA", "LangGraph")
    }
    assert {(r["state"], r["writers"], r["system"]) for r in writes} >= expected
    assert all(r["checkpoints/s"]["median"] > 0 for r in writes)
    hop = "Kafka hop alone (same settings)"
    durable = "Kafka hop + one INSERT per batch (same settings)"
    for system in (hop, durable):
        assert {r["writers"] for r in writes if r["system"] == system} == {1, 50}
    # the ceiling: the least durable consumer against LangGraph, and ALMA against it
    ceiling = {(r["state"], r["writers"]): r for r in tables["ceiling"]["rows"]}
    assert set(ceiling) == {(s, w) for s in ("5 KB", "100 KB") for w in (1, 50)}
    for (_, writers), row in ceiling.items():
        assert row["durable hop ÷ LangGraph"]["median"] > 0
        assert row["ALMA ÷ durable hop"]["median"] > 0
        own = row["ALMA, own process ÷ durable hop"]
        assert own == "—" if writers == 1 else own["median"] > 0
    # where the CPU goes, measured from the processes themselves: each system's own parts
    cpu = {(r["state"], r["system"]): r for r in tables["cpu"]["rows"]}
    assert set(cpu) == {
        (s, system)
        for s in ("5 KB", "100 KB")
        for system in (
            "ALMA",
            "ALMA, checkpointer in its own process",
            "LangGraph",
            hop,
            durable,
            "ALMA, records uncompressed",
            "Kafka hop + one INSERT per batch, records uncompressed",
        )
    }
    # the 50 writers with the default codec (zstd) beside the same loops uncompressed
    codec = {(r["state"], r["system"]): r for r in tables["codec"]["rows"]}
    assert set(codec) == {(s, system) for s in ("5 KB", "100 KB") for system in ("ALMA", durable)}
    assert all(r["checkpoints/s ×"]["median"] > 0 for r in codec.values())
    assert all(r["CPU per checkpoint ×"]["median"] > 0 for r in codec.values())
    assert len(tables["codec"]["notes"]) == 2  # a sentence per size, from these rows
    # CPU times come in clock ticks (10 ms): a part that did little in a quick 5 KB loop
    # can read 0 on a fast machine, so each part is checked over both state sizes.
    used: dict[str, dict[str, float]] = {}
    for (_, system), row in cpu.items():
        assert 0 < row["machine busy %"]["median"] <= 100
        this = {k.removesuffix(" ms"): v["median"] for k, v in row.items() if k.endswith(" ms")}
        assert this["total"] >= this["benchmark process"]
        summed = used.setdefault(system, {})
        for part, ms in this.items():
            summed[part] = summed.get(part, 0.0) + ms
    for system, parts in used.items():
        assert parts["benchmark process"] > 0, (system, parts)
        if system != "LangGraph":  # every other loop goes through the broker
            assert parts["broker"] > 0, (system, parts)
        if system != hop:  # every other loop writes to PostgreSQL
            assert parts["PostgreSQL"] > 0, (system, parts)
        if system == "ALMA, checkpointer in its own process":
            assert parts["worker processes"] > 0, (system, parts)
    capacity = tables["capacity"]["rows"]
    assert [r["state"] for r in capacity] == ["1 KB", "5 KB", "100 KB"]
    for row in capacity:  # every backlog drained (a stalled drain fails the run)
        assert row["ALMA checkpoints/s"]["median"] > 0
        assert row["LangGraph checkpoints/s"]["median"] > 0
    assert [r["checkpoints in run"] for r in tables["reads"]["rows"]] == [10, 1000]
    alma = [r for r in tables["run_state"]["rows"] if r["system"].startswith("ALMA")]
    assert len(alma) == 2
    for row in alma:  # the guarantee: concurrent increments and appends all count
        assert row["lost increments"]["max"] == 0
        assert row["lost actions"]["max"] == 0
    for row in tables["storage"]["rows"]:
        per_checkpoint = [int(v.replace(",", "")) for k, v in row.items() if k != "state"]
        assert len(per_checkpoint) == 4
        assert min(per_checkpoint) > 0


@pytest.mark.timeout(300)
@pytest.mark.slow
async def test_a_short_soak_through_alma_up_writes_its_windows(
    settings: Settings, tmp_path: Path
) -> None:
    """`--only soak`, shortened: `alma up` of its own, a steady load from another Kafka
    client, a row per window with latency and every service's memory, every event
    applied exactly once, the verdicts noted, the plot drawn."""
    out = tmp_path / "benchmarks.md"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    rc, log = await bench(
        settings,
        scratch,
        "--only",
        "soak",
        "--soak-seconds",
        "24",
        "--window-seconds",
        "12",
        "--out",
        str(out),
    )
    assert rc == 0, log[-3000:]
    # alma up's data went with it (PyTorch keeps a compile cache of its own there)
    assert not [p for p in scratch.iterdir() if p.name.startswith("alma-")]
    table = json.loads(out.with_suffix(".json").read_text())["soak"]["tables"]["soak"]
    assert [float(row["window (min)"]) for row in table["rows"]] == [0.2, 0.4]
    for row in table["rows"]:
        assert float(row["events/s"]) > 100
        assert float(row["p50 ms"].replace(",", "")) > 0
        for service in ("broker", "workers", "redis", "postgres"):
            assert float(row[f"{service} MB"].replace(",", "")) > 1, (service, row)
        assert int(row["longest partition (records)"].replace(",", "")) > 0
    assert "every event applied exactly once." in table["notes"][0]
    assert "p50, last window against the first" in table["notes"][1]
    assert (tmp_path / "img" / "bench-soak.png").exists()


async def test_an_unknown_suite_is_refused_with_the_choices(
    settings: Settings, tmp_path: Path
) -> None:
    rc, log = await bench(settings, tmp_path, "--only", "nonsense")
    assert rc == 2
    assert "unknown suite(s) ['nonsense']" in log
    assert "peers" in log
    assert "scaling" in log
    assert "soak" in log


def _name(p: psutil.Process) -> str:
    """A process's name, or "" for one that ended since it was listed (a short-lived
    child of the stack's start-up, such as initdb's)."""
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


@pytest.mark.timeout(120)
async def test_a_benchmark_stopped_with_sigterm_stops_its_embedded_stack(tmp_path: Path) -> None:
    """Without services given, a benchmark starts its own broker, PostgreSQL and Redis;
    killed with SIGTERM (a timeout, a kill), it stops them rather than leaving them
    running beside the next benchmark, and removes their data (gigabytes, once a
    learner benchmark has filled it)."""
    proc = await spawn(
        {}, tmp_path, "--quick", "--only", "peers", output=asyncio.subprocess.DEVNULL
    )
    bench_process = psutil.Process(proc.pid)
    services: list[psutil.Process] = []
    deadline = time.monotonic() + 60
    while len(services) < 3 and time.monotonic() < deadline:  # broker, PostgreSQL, Redis
        await asyncio.sleep(0.5)
        services = [
            p
            for p in bench_process.children(recursive=True)
            if any(n in _name(p) for n in ("tansu", "postgres", "redis"))
        ]
    assert len(services) >= 3, [p.name() for p in services]
    await asyncio.sleep(5)  # past the stack's start, into the benchmark proper
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(proc.wait(), 60)
    _, alive = await asyncio.to_thread(psutil.wait_procs, services, timeout=30)
    left = [(p.pid, p.name()) for p in alive]
    for p in alive:  # what a failure leaves is not left to the next test
        p.kill()
    assert not left, left
    assert not os.listdir(tmp_path)
