"""The benchmark report's arithmetic and files: medians with their spread, paired
ratios, sections kept apart in the markdown and merged in the JSON, and the
numbers the plots read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import plots
from bench.peers import realistic_state
from bench.report import Section, Stat, cpu, machine, ratio, write


def test_stat_is_the_median_with_the_lowest_and_highest_run() -> None:
    s = Stat([3.0, 1.0, 2.0, 10.0], 1)
    assert s.median == 2.5
    assert str(s) == "2.5 (1.0–10.0)"
    assert s.to_json() == {"median": 2.5, "min": 1.0, "max": 10.0, "runs": [3.0, 1.0, 2.0, 10.0]}
    assert str(Stat([4.0], 0)) == "4"


def test_ratio_pairs_repetitions() -> None:
    r = ratio(Stat([10.0, 40.0, 9.0]), Stat([5.0, 10.0, 3.0]))
    assert r.runs == [2.0, 4.0, 3.0]
    assert r.median == 3.0
    with pytest.raises(ValueError, match="shorter"):
        ratio(Stat([1.0, 2.0]), Stat([1.0]))


def test_write_replaces_only_its_section_and_merges_the_json(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(
        "# Title\n\nprose before\n\n<!-- bench:a:start -->\nold\n"
        "<!-- bench:a:end -->\n\nprose after\n"
    )
    m = machine({"PostgreSQL": "18"})
    a = Section("a")
    a.table("t", "Table A", ["x", "y"])
    a.add("t", [1, Stat([1.0, 3.0])])
    a.note("t", "a note")
    write([a], m, out, "quick")
    b = Section("b")
    b.table("u", "Table B", ["z"])
    b.add("u", ["only"])
    write([b], m, out, "quick")
    text = out.read_text()
    assert "old" not in text
    assert text.index("prose before") < text.index("### Table A") < text.index("prose after")
    assert text.index("prose after") < text.index("### Table B")
    assert "| 1 | 2.00 (1.00–3.00) |" in text
    assert "a note" in text
    doc = json.loads(out.with_suffix(".json").read_text())
    assert set(doc) == {"a", "b"}
    assert doc["a"]["tables"]["t"]["rows"] == [
        {"x": 1, "y": {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [1.0, 3.0]}}
    ]
    assert doc["a"]["machine"]["services"] == {"PostgreSQL": "18"}


def test_plots_read_cells_as_numbers() -> None:
    assert plots.num({"median": 2.5, "min": 1, "max": 3, "runs": []}) == 2.5
    assert plots.num("10,000") == 10_000
    assert plots.num("5 KB") == 5_000
    assert plots.num("1 MB") == 1_000_000
    assert plots.num(64) == 64


def test_plots_draw_the_curves_from_the_json(tmp_path: Path) -> None:
    curves = Section("curves")
    headers = [
        "branches",
        "state per branch",
        "ALMA merge p50 ms",
        "LangGraph reducers p50 ms",
        "ALMA ÷ LangGraph",
    ]
    curves.table("merge_branches", "m", headers)
    curves.table("merge_size", "s", headers)
    for n in (2, 4):
        curves.add("merge_branches", [n, "5 KB", Stat([0.1 * n]), Stat([0.02 * n]), Stat([5.0])])
        curves.add("merge_size", [5, f"{n} KB", Stat([0.1 * n]), Stat([0.02 * n]), Stat([5.0])])
    out = tmp_path / "benchmarks.md"
    write([curves], machine(), out, "quick")
    made = plots.draw(out.with_suffix(".json"), tmp_path / "img")
    assert [p.name for p in made] == ["bench-merge.png"]
    assert made[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("size", [1_000, 5_000, 100_000])
def test_realistic_states_have_about_the_size_asked_for(size: int) -> None:
    state = realistic_state(size, seed=size)
    length = len(json.dumps(state))
    assert 0.8 * size <= length <= 1.3 * size
    assert len({m["content"] for m in state["messages"]}) > len(state["messages"]) // 2


def test_the_machine_line_names_the_cpu_and_its_widest_vector_extension() -> None:
    def info(flags: str) -> str:
        return f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n"

    assert cpu(info("avx2 avx512f avx512_bf16 avx512_vnni")) == "AMD EPYC, AVX-512 BF16"
    assert cpu(info("avx2 avx512f")) == "AMD EPYC, AVX-512"
    assert cpu(info("avx2 amx_tile avx512_bf16")) == "AMD EPYC, AMX"
    assert cpu(info("avx2")) == "AMD EPYC, AVX2"
    assert cpu(info("")) == "AMD EPYC, no AVX2"
    assert cpu("") == "unknown CPU, no AVX2"
