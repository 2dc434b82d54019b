"""The README cannot drift from the code: its Python blocks compile (the integration
test `test_newcomer.py` runs them against `alma up`), its excerpts are lines of the
examples they name (which the suite runs), and every command its shell blocks show
exists: `alma` commands in the CLI, `make` targets in the Makefile, scripts on disk."""

from __future__ import annotations

import ast
import json
import re
import shlex
import tomllib
from typing import Any

import typer.main

from alma_core.cli import app
from alma_core.reducers import ENTRY_POINT_GROUP
from tests.readme_blocks import ROOT, blocks, missing_from_source, runnable


def test_every_python_block_runs_or_is_an_excerpt_of_an_example() -> None:
    python = [b for b in blocks() if b.language == "python"]
    assert len(python) >= 7, "the README's Python blocks were found"
    for block in runnable():
        compile(block.text, f"README.md:{block.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    excerpts = [b for b in python if b.excerpt_of is not None]
    assert {b.excerpt_of.name for b in excerpts if b.excerpt_of} >= {
        "agtestari_temporal.py",
        "langgraph_agent.py",
    }
    for block in excerpts:
        assert block.excerpt_of is not None
        assert block.excerpt_of.exists(), block
        assert missing_from_source(block) == [], (block.line, block.excerpt_of)


def test_an_excerpt_that_drifted_is_caught() -> None:
    (block,) = [b for b in blocks() if b.excerpt_of and b.excerpt_of.name == "langgraph_agent.py"]
    drifted = type(block)(
        block.language, block.text.replace("acomplete", "afinish"), 0, block.excerpt_of
    )
    assert missing_from_source(drifted) == [
        "outcome = await saver.afinish(thread, task=task)  # ALMA learns from the thread"
    ]


def cli_paths() -> set[tuple[str, ...]]:
    """Every command of `alma`, as the words that call it."""
    found: set[tuple[str, ...]] = set()
    todo: list[tuple[tuple[str, ...], Any]] = [((), typer.main.get_command(app))]
    while todo:  # typer's click may be its own copy: groups are what has commands
        words, command = todo.pop()
        found.add(words)
        for name, sub in getattr(command, "commands", {}).items():
            todo.append(((*words, name), sub))
    return found


def test_every_command_of_the_shell_blocks_exists() -> None:
    commands = cli_paths()
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    seen = 0
    for block in blocks():
        if block.language != "bash":
            continue
        for raw in block.text.splitlines():
            line = raw.split("#")[0].strip()
            if not line:
                continue
            words = shlex.split(line)
            seen += 1
            if words[0] == "alma":
                called = tuple(w for w in words[1:3] if not w.startswith("-"))
                assert called[:1] in commands or called in commands, line
                assert called[:2] in commands or called[:1] in commands, line
            elif words[:2] == ["pip", "install"]:
                extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
                    "optional-dependencies"
                ]
                for spec in words[2:]:
                    named = re.fullmatch(r"alma-stream\[([a-z,]+)\]", spec)
                    assert named, line
                    assert set(named.group(1).split(",")) <= set(extras), line
            elif words[0] == "make":
                assert words[1] in targets, line
            elif words[0].endswith("python"):
                script = words[1] if words[1] != "-m" else words[2].replace(".", "/")
                assert (ROOT / script).exists() or (ROOT / script / "__main__.py").exists(), line
            else:
                raise AssertionError(
                    f"README.md:{block.line}: a command the test does not know: {line}"
                )
    assert seen >= 6


def test_the_config_blocks_parse_and_name_what_exists() -> None:
    (mcp,) = [b for b in blocks() if b.language == "json"]
    server = json.loads(mcp.text)["mcpServers"]["alma"]
    assert (server["command"], *server["args"]) == ("alma", "mcp")
    assert ("mcp",) in cli_paths()
    (entry_points,) = [b for b in blocks() if b.language == "toml"]
    assert ENTRY_POINT_GROUP in tomllib.loads(entry_points.text)["project"]["entry-points"]


def test_every_file_the_readme_points_to_is_in_the_repository() -> None:
    """Links and code paths name files of this repository (the guarantees included,
    docs/guarantees.md), nothing outside it such as ../shared/."""
    text = (ROOT / "README.md").read_text()
    linked = re.findall(r"\]\(([^)#]+)\)", text)
    assert "docs/guarantees.md" in linked
    for target in linked:
        assert not target.startswith(("..", "/")), target
        assert target.startswith("http") or (ROOT / target).exists(), target
    assert "../" not in text
