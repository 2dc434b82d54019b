"""Benchmark reports: tables on the terminal, and the same tables as markdown in
this benchmark's own section of docs/benchmarks.md (the prose around is kept)."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from pathlib import Path

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


def machine() -> str:
    mem = psutil.virtual_memory().total / 2**30
    return (f"{os.cpu_count()} cores, {mem:.0f} GiB, {platform.platform()}, "
            f"Python {platform.python_version()}, {datetime.now(UTC):%Y-%m-%d}")  # fmt: skip


def report(
    section: str,
    rows: dict[str, list[list[str]]],
    headers: dict[str, list[str]],
    titles: dict[str, str],
    out: Path | None,
) -> None:
    lines = [f"Machine: {machine()}", ""]
    for name, body in rows.items():
        table = Table(title=titles[name])
        for h in headers[name]:
            table.add_column(h)
        for row in body:
            table.add_row(*(str(c) for c in row))
        console.print(table)
        lines += [f"### {titles[name]}", "", "| " + " | ".join(headers[name]) + " |",
                  "|" + "---|" * len(headers[name]),
                  *("| " + " | ".join(map(str, r)) + " |" for r in body), ""]  # fmt: skip
    console.print(lines[0])
    if out is not None:
        write_section(out, "\n".join(lines), section)
        console.print(f"written to {out}")


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
