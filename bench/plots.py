"""The cost curves as PNGs, drawn from docs/benchmarks.json (what ``python -m bench``
wrote), so the committed pictures are the committed numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Row = dict[str, Any]


def num(cell: Any) -> float:
    """A table cell as a number: a Stat's median, or the first number in the text."""
    if isinstance(cell, dict):
        return float(cell["median"])
    if isinstance(cell, int | float):
        return float(cell)
    text = str(cell).replace(",", "")
    m = re.search(r"[\d.]+", text)
    if m is None:
        return float("nan")
    scale = 1_000_000 if "MB" in text else 1_000 if "KB" in text else 1
    return float(m.group()) * scale


def spread(rows: list[Row], key: str) -> tuple[list[float], list[list[float]]]:
    """Medians and the error bars (distance to the lowest and highest repetition)."""
    mids, lo, hi = [], [], []
    for r in rows:
        c = r[key]
        mid = num(c)
        mids.append(mid)
        lo.append(mid - float(c["min"]) if isinstance(c, dict) else 0.0)
        hi.append(float(c["max"]) - mid if isinstance(c, dict) else 0.0)
    return mids, [lo, hi]


def lines(ax: Any, rows: list[Row], x: str, series: dict[str, str]) -> None:
    xs = [num(r[x]) for r in rows]
    for label, key in series.items():
        ys, err = spread(rows, key)
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(source: Path, out: Path) -> list[Path]:
    doc = json.loads(source.read_text())
    curves = doc.get("curves", {}).get("tables", {})
    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    if load := curves.get("load", {}).get("rows"):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for system in ("ALMA", "LangGraph"):
            rows = [r for r in load if r["system"] == system]
            lines(a, rows, "offered ev/s", {system: "achieved ev/s"})
            lines(b, rows, "offered ev/s", {f"{system} p99": "p99 ms"})
        top = max(num(r["offered ev/s"]) for r in load)
        a.plot([0, top], [0, top], "k:", linewidth=1, label="offered")
        a.set(
            xlabel="offered checkpoints/s",
            ylabel="achieved checkpoints/s",
            title="Throughput against offered load",
            xscale="log",
            yscale="log",
        )
        b.set(
            xlabel="offered checkpoints/s",
            ylabel="p99 ms",
            title="p99 against offered load",
            xscale="log",
            yscale="log",
        )
        made.append(save(fig, out / "bench-load.png"))
    for key, x, title in (
        ("run_length", "checkpoints in run", "run length"),
        ("table_size", "checkpoints in table", "table size"),
    ):
        if rows := curves.get(key, {}).get("rows"):
            fig, ax = plt.subplots(figsize=(7, 4))
            lines(ax, rows, x, {h: h for h in sorted(rows[0]) if h != x})
            ax.set(
                xlabel=x,
                ylabel="p50 ms",
                title=f"Write and read cost against {title}",
                xscale="log",
                yscale="log",
            )
            made.append(save(fig, out / f"bench-{key.replace('_', '-')}.png"))
    branches = curves.get("merge_branches", {}).get("rows")
    sizes = curves.get("merge_size", {}).get("rows")
    if branches and sizes:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        series = {
            "ALMA merge": "ALMA merge p50 ms",
            "LangGraph reducers": "LangGraph reducers p50 ms",
        }
        lines(a, branches, "branches", series)
        lines(b, sizes, "state per branch", series)
        a.set(
            xlabel="branches (5 KB each)",
            ylabel="p50 ms",
            title="Merge cost against branches",
            xscale="log",
            yscale="log",
        )
        b.set(
            xlabel="bytes per branch (5 branches)",
            ylabel="p50 ms",
            title="Merge cost against state size",
            xscale="log",
            yscale="log",
        )
        made.append(save(fig, out / "bench-merge.png"))
    if rows := curves.get("retrieval", {}).get("rows"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for scope in dict.fromkeys(r["scope"] for r in rows):
            mine = [r for r in rows if r["scope"] == scope]
            ax.plot(
                [num(r["memories"]) for r in mine],
                [num(r["auto p50 ms"]) for r in mine],
                marker="o",
                label=scope,
            )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set(
            xlabel="memories in the table",
            ylabel="p50 ms (plan chosen)",
            title="Scoped retrieval against memory count",
            xscale="log",
        )
        made.append(save(fig, out / "bench-retrieval.png"))
    if rows := doc.get("soak", {}).get("tables", {}).get("soak", {}).get("rows"):
        made.append(soak(rows, out / "bench-soak.png"))
    scaling = doc.get("scaling", {}).get("tables", {}).get("scaling", {}).get("rows")
    if scaling:
        fig, ax = plt.subplots(figsize=(5, 4))
        ys, err = spread(scaling, "checkpoints/s")
        ax.bar([str(r["processes"]) for r in scaling], ys, yerr=err, capsize=4)
        ax.set(
            xlabel="checkpointer processes", ylabel="checkpoints/s", title="Scaling on this machine"
        )
        made.append(save(fig, out / "bench-scaling.png"))
    return made


def soak(rows: list[Row], path: Path) -> Path:
    """The soak over time: latency percentiles, and each service's memory."""
    minutes = [num(r["window (min)"]) for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p in ("p50 ms", "p95 ms", "p99 ms"):
        a.plot(minutes, [num(r[p]) for r in rows], marker="o", label=p.split()[0])
    a.set(xlabel="minutes", ylabel="ms from emitted_at to checkpoint", yscale="log")
    a.set_title("Latency per window")
    for key in [k for k in rows[0] if k.endswith(" MB")]:
        b.plot(minutes, [num(r[key]) for r in rows], marker="o", label=key[:-3])
    b.set(xlabel="minutes", ylabel="MB", title="Memory at each window's end")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, path)
