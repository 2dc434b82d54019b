"""ALMA Stream as users install it: the wheel built from this checkout, installed into a
fresh virtual environment that holds the wheel and exactly the distributions its
requirements name with the chosen extras, followed transitively (nothing of the
checkout, no test tool, no other package of the development environment).

The dependencies are not downloaded again (PyTorch alone is ~3 GB): each is linked from
the development environment, where they are installed, into the fresh environment's
site-packages, and ``pip check`` there proves the set complete. Distributions that
share a top-level folder (``nvidia``, ``google``) bring all of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# what the Dockerfile copies to build the project: the wheel is built from these only
SOURCE = ("pyproject.toml", "README.md", "alma_core", "schemas", "consumers")
LAPTOP = ("all", "embedded")  # the README's install line for a laptop


@dataclass(frozen=True)
class Installed:
    """A fresh environment with the wheel in it."""

    root: Path
    site: Path
    distributions: frozenset[str]  # canonical names, the wheel's own included

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def alma(self) -> Path:
        return self.root / "bin" / "alma"


def pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def build_wheel(out: Path) -> Path:
    """The wheel of this checkout, built from a copy of what the image copies (no
    ``build/`` or egg-info left in the checkout), offline."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in SOURCE:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(
                path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(path, src / name)
    built = pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out, src)
    assert built.returncode == 0, f"pip wheel failed:\n{built.stdout}\n{built.stderr}"
    (wheel,) = out.glob("alma_stream-*.whl")
    return wheel


def required(requirements: list[str], extras: tuple[str, ...]) -> list[Requirement]:
    """The requirements that apply on this interpreter with ``extras`` chosen."""
    chosen = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            chosen.append(req)
    return chosen


def closure(
    own: metadata.Distribution, extras: tuple[str, ...]
) -> dict[str, metadata.Distribution]:
    """Every distribution ``own`` (the wheel) needs with ``extras``, transitively, as
    installed in the development environment; its own extras followed."""
    name = canonicalize_name(own.metadata["Name"])
    found: dict[str, metadata.Distribution] = {}
    todo = deque(required(own.requires or [], extras))
    own_extras = set(extras)
    while todo:
        req = todo.popleft()
        key = canonicalize_name(req.name)
        if key == name:  # alma-stream[learn,cli]: its own extras
            more = tuple(sorted(set(req.extras) - own_extras))
            own_extras.update(more)
            todo.extend(required(own.requires or [], more))
            continue
        if key in found:
            continue
        dist = metadata.distribution(req.name)
        assert req.specifier.contains(dist.version, prereleases=True), (
            f"{req} wanted, {dist.version} installed: run `make .venv/.installed`"
        )
        found[key] = dist
        todo.extend(required(dist.requires or [], tuple(req.extras)))
    return found


def install(root: Path, wheel: Path, extras: tuple[str, ...] = LAPTOP) -> Installed:
    """A fresh environment at ``root``: the wheel installed by pip, its dependencies
    with ``extras`` linked in; ``pip check`` passes there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True, timeout=120)
    python = root / "bin" / "python"
    done = pip("--python", python, "install", "--no-deps", "--no-index", wheel)
    assert done.returncode == 0, f"pip install failed:\n{done.stdout}\n{done.stderr}"
    (site,) = root.glob("lib/python*/site-packages")
    (own,) = (d for d in metadata.distributions(path=[str(site)]) if d.metadata["Name"])
    needed = closure(own, extras)
    for dist in needed.values():
        files = dist.files
        assert files is not None, f"{dist.metadata['Name']} lists no files (no RECORD)"
        base = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in files if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            link = site / top
            if not link.exists() and (base / top).exists():
                link.symlink_to(base / top)
    checked = pip("--python", python, "check")
    assert checked.returncode == 0, f"pip check in {root}:\n{checked.stdout}{checked.stderr}"
    return Installed(root, site, frozenset({canonicalize_name(own.metadata["Name"]), *needed}))
