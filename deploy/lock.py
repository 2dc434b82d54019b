"""Writes deploy/requirements.lock from pip's resolution report (``make lock``).

``make lock`` resolves ``.[all]`` beside PyPI's build of the image's PyTorch version on
Python 3.11 for Linux (``pip install --dry-run --report``: nothing is downloaded past the
packages' metadata, and PyTorch's CPU index need not be reachable). The image installs
PyTorch's CPU build instead (``torch==X+cpu``, deploy/Dockerfile): this script pins that,
and leaves out what only PyPI's CUDA build of PyTorch requires (its CUDA libraries:
``nvidia-*``, ``cuda-*``, ``triton``), which the CPU build does not. The image's
``pip check`` fails its build if the result misses anything.

    python deploy/lock.py REPORT.json torch==2.13.0+cpu > deploy/requirements.lock
"""

from __future__ import annotations

import json
import re
import sys

HEADER = """\
# The worker image's dependencies, pinned: what `pip install '.[all]'` installs on
# Python 3.11 (Linux) with PyTorch's CPU build. deploy/Dockerfile installs these with
# --no-deps, then the project itself. Regenerate with `make lock` (after changing the
# dependencies in pyproject.toml, or to take upgrades); do not edit by hand."""
CUDA_ONLY = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
PROJECT = "alma-stream"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(report: dict[str, object], torch: str) -> list[str]:
    """``name==version`` of each package the report installs, sorted as ``pip freeze``
    sorts them, the CPU build of PyTorch in place of PyPI's."""
    install = report["install"]
    assert isinstance(install, list)
    found = {item["metadata"]["name"]: item["metadata"]["version"] for item in install}
    lines = []
    for name, version in found.items():
        key = canonical(name)
        if key == PROJECT or CUDA_ONLY.match(key):
            continue
        lines.append(torch if key == "torch" else f"{name}=={version}")
    return sorted(lines, key=str.lower)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        report = json.load(f)
    print(HEADER)
    print("\n".join(pins(report, argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
