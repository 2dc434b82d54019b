# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
#   make demo   run realistic workflows through the SDK on the embedded stack and
#               print what ALMA Stream made of them (the main job, start to finish)
#   make up     start the embedded stack (Kafka-protocol broker, PostgreSQL+pgvector,
#               Redis), create topics, migrate, run the workers, until Ctrl-C
#   make test   lint, type-check and run the whole test suite on real services
#   make bench  every benchmark, side by side with LangGraph and a JSONB column, written
#               to docs/benchmarks.md (+ .json, docs/img/*.png); BENCH="--quick" for ~3 min
#
# TORCH picks the PyTorch build installed before the project. The default is the
# CPU build; for a GPU build use e.g. `make up TORCH="torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cu128"` (any CUDA wheel index you can reach).

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: up demo bench test lint typecheck unit integration clean-venv tools

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) (PyTorch: $(TORCH))"
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --progress-bar on $(TORCH)
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	@touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/alma up

demo: $(STAMP)
	$(VENV)/bin/alma demo

BENCH ?=
bench: $(STAMP)
	$(PY) -m bench $(BENCH) --out docs/benchmarks.md

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP) tools
	$(PY) -m pytest tests/integration

# Test tools that come from Debian, not PyPI: Prometheus (a real server scrapes a
# worker in the tests) and promtool (checks the alert rules).
tools:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "==> installing Debian's prometheus (tests scrape a worker with it)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }

test: lint typecheck tools
	$(PY) -m pytest

clean-venv:
	rm -rf $(VENV)
