"""The folders state the architecture; this test keeps them honest by reading every
module's imports (with ``ast``, importing nothing).

* The root of ``alma_core`` is the pure core and its config: no asyncio, no
  PostgreSQL, Redis or Kafka client, nothing from ``storage``, ``sdk``,
  ``integrations``, ``cli`` or ``consumers``.
* ``schemas`` is the event contract: it imports nothing of ours.
* ``storage`` (the PostgreSQL/Redis edges) never reaches up into ``sdk``, ``cli``
  or ``consumers``; ``sdk`` never into ``cli`` or ``consumers``.
* ``consumers`` never imports the command line or the SDK.
* Only ``alma_core/cli/stack.py`` imports ``consumers``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IO_LIBRARIES = ("asyncio", "asyncpg", "redis", "aiokafka")


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports, absolute, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
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


def modules(folder: str, *, recursive: bool = True) -> list[Path]:
    pattern = "**/*.py" if recursive else "*.py"
    return sorted((ROOT / folder).glob(pattern))


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
        "consumers",
    )
    assert offenders(modules("alma_core", recursive=False), forbidden) == {}


def test_schemas_import_nothing_of_ours() -> None:
    assert offenders(modules("schemas"), ("alma_core", "consumers")) == {}


def test_storage_never_reaches_up() -> None:
    forbidden = ("alma_core.sdk", "alma_core.cli", "alma_core.integrations", "consumers")
    assert offenders(modules("alma_core/storage"), forbidden) == {}


def test_sdk_never_reaches_the_command_line_or_the_workers() -> None:
    assert offenders(modules("alma_core/sdk"), ("alma_core.cli", "consumers")) == {}


def test_consumers_never_import_the_command_line_or_the_sdk() -> None:
    forbidden = ("alma_core.cli", "alma_core.sdk", "alma_core.integrations")
    assert offenders(modules("consumers"), forbidden) == {}


def test_only_the_stack_command_imports_consumers() -> None:
    importers = offenders(modules("alma_core") + modules("schemas"), ("consumers",))
    assert set(importers) == {"alma_core/cli/stack.py"}


def test_the_checker_sees_what_it_must() -> None:
    """The reader of imports finds plain, from- and relative imports (else every test
    above would pass vacuously)."""
    sample = ROOT / "alma_core" / "storage" / "cache.py"
    assert "redis.asyncio" in imports_of(sample)
    assert "alma_core.errors" in imports_of(sample)
    stack = imports_of(ROOT / "alma_core" / "cli" / "stack.py")
    assert any(reaches(n, ("consumers",)) for n in stack)
