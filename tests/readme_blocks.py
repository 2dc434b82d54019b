"""The README's code blocks, read so that tests can run them: a Python block is run
(the blocks go on from one another, as typed into ``python -m asyncio``) unless the line
before it says ``<!-- excerpt of PATH -->``, in which case its lines must be lines of
PATH, in order (``...`` stands for lines left out)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXCERPT = re.compile(r"<!-- excerpt of (\S+) -->")


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    line: int  # where the block starts in the README (1-based), for messages
    excerpt_of: Path | None = None


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i]
        if fence.startswith("```"):
            start = i
            body: list[str] = []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            marker = EXCERPT.search(lines[start - 1]) if start else None
            source = ROOT / marker.group(1) if marker else None
            found.append(Block(fence[3:].strip(), "\n".join(body) + "\n", start + 1, source))
        i += 1
    return found


def runnable(path: Path = README) -> list[Block]:
    """The Python blocks to run, in order."""
    return [b for b in blocks(path) if b.language == "python" and b.excerpt_of is None]


def missing_from_source(block: Block) -> list[str]:
    """The lines of an excerpt that are not, in this order, lines of its source."""
    assert block.excerpt_of is not None
    source = [line.strip() for line in block.excerpt_of.read_text().splitlines()]
    missing, at = [], 0
    for line in (raw.strip() for raw in block.text.splitlines()):
        if not line or line == "...":
            continue
        try:
            at = source.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


RUNNER = """
import ast, asyncio, json, sys

async def main(blocks):
    namespace = {"__name__": "__readme__"}
    for line, text in blocks:
        code = compile(text, f"README.md:{line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if asyncio.iscoroutine(result):
            await result
        print(f"README.md:{line} ran", flush=True)

asyncio.run(main(json.load(sys.stdin)))
"""
"""A script that runs the blocks it reads (JSON ``[[line, text], ...]`` on stdin) in one
namespace, top-level ``await`` allowed, as ``python -m asyncio`` would."""


SECURED = "alma up --secure"  # the first line of the walkthrough on a secured stack


def shell_commands(*, secured: bool) -> list[list[str]]:
    """The words of each `alma` command of the README's shell blocks: those of the
    walkthrough on `alma up --secure` (``secured``: tests/integration/test_secure_stack.py
    walks it), or of every other block."""
    found = []
    for block in blocks():
        if block.language != "bash" or block.text.lstrip().startswith(SECURED) != secured:
            continue
        for raw in block.text.splitlines():
            words = shlex.split(raw.split("#")[0])
            if words[:1] == ["alma"]:
                found.append(words[1:])
    return found
