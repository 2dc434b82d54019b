"""deploy/lock.py turns pip's resolution report into the image's lock: the CPU build of
PyTorch in place of PyPI's, none of the CUDA libraries only PyPI's build requires, not
the project itself, sorted as `pip freeze` sorts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def lock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lock", ROOT / "deploy" / "lock.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(*pairs: tuple[str, str]) -> dict[str, object]:
    return {"install": [{"metadata": {"name": n, "version": v}} for n, v in pairs]}


def test_the_lock_pins_the_cpu_build_and_leaves_cuda_out() -> None:
    resolved = report(
        ("torch", "2.13.0"),
        ("nvidia-cublas", "13.1.1.3"),
        ("nvidia-cudnn-cu13", "9.20.0.48"),
        ("cuda-bindings", "13.5.0"),
        ("triton", "3.7.1"),
        ("alma-stream", "0.1.0"),
        ("PyYAML", "6.0.4"),
        ("aiokafka", "0.14.0"),
        ("Jinja2", "3.1.6"),
        ("tritonclient", "2.1"),  # a name that merely starts like a CUDA library stays
    )
    assert lock_module().pins(resolved, "torch==2.13.0+cpu") == [
        "aiokafka==0.14.0",
        "Jinja2==3.1.6",
        "PyYAML==6.0.4",
        "torch==2.13.0+cpu",
        "tritonclient==2.1",
    ]


def test_the_lock_in_the_repository_has_no_cuda_library() -> None:
    lines = (ROOT / "deploy" / "requirements.lock").read_text().splitlines()
    names = [line.split("==")[0].lower() for line in lines if line and not line.startswith("#")]
    assert "torch" in names
    assert not [n for n in names if lock_module().CUDA_ONLY.match(n)]
