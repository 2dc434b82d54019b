# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
#   make demo   run realistic workflows through the SDK on the embedded stack and
#               print what ALMA Stream made of them (the main job, start to finish)
#   make up     start the embedded stack (Apache Kafka where Java is, else Tansu;
#               PostgreSQL+pgvector, Redis), create topics, migrate, run the workers
#   make kafka  copy Apache Kafka's broker jars (Maven) for the embedded stack and tests
#   make test   lint, type-check and run the whole test suite on real services
#   make postgres15  Debian's PostgreSQL 15 with pgvector, the oldest PostgreSQL tested
#   make faults lose each machine of a cluster of real hosts (network namespaces, as
#               root) and print what was acknowledged, applied, lost and doubled
#   make check  the developer loop (~2 min): lint, types, the unit tests with fewer
#               hypothesis examples and one smoke test of each part on real services;
#               `pytest -m "not slow"` leaves out the slow integration and chaos tests
#   make bench  every benchmark, side by side with LangGraph and a JSONB column, written
#               to docs/benchmarks.md (+ .json, docs/img/*.png); BENCH="--quick" for ~3 min
#   make lock   re-pin the worker image's dependencies (deploy/requirements.lock)
#   make image  build the worker image, alma-stream:<version> (needs Docker)
#
# PyTorch is installed first, alone (--no-deps: only torch is looked up there), from
# TORCH_INDEX; its dependencies and everything else come from pip's usual index. The
# default is the CPU build everywhere: on Linux torch==2.13.0+cpu from PyTorch's CPU
# index (PyPI's Linux wheel is the multi-GB CUDA build), elsewhere PyPI's own wheel
# (CPU already). Where TORCH cannot be had (TORCH_INDEX unreachable and no wheel in
# pip's find-links), PyPI's build of the same version is installed instead
# (TORCH_PYPI): a CUDA build that runs on the CPU, ~3 GB with its CUDA libraries, ~2
# minutes more. For a GPU build: `make up TORCH=torch==2.13.0+cu128
# TORCH_INDEX=https://download.pytorch.org/whl/cu128` (any CUDA wheel index you can
# reach), in a fresh .venv (`make clean-venv`).

VENV ?= .venv
PY := $(VENV)/bin/python
ifeq ($(shell uname -s),Linux)
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
else
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://pypi.org/simple
endif
TORCH_PYPI ?= torch==2.13.0
STAMP := $(VENV)/.installed

# The worker image (deploy/Dockerfile): tagged with the project's version, its
# dependencies pinned in LOCK for Python 3.11 on Linux with the CPU build of PyTorch.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= alma-stream:$(VERSION)
LOCK := deploy/requirements.lock
LOCK_PYTHON ?= python3.11
IMAGE_TORCH := torch==2.13.0+cpu
IMAGE_TORCH_VERSION := $(patsubst torch==%+cpu,%,$(IMAGE_TORCH))
IMAGE_TORCH_INDEX := https://download.pytorch.org/whl/cpu

# Apache Kafka's broker (the embedded stack's, the suite's): its jars, copied by Maven
# from the pom that names the version, into a cache that every clone shares.
KAFKA_POM := alma_core/cli/kafka/pom.xml
KAFKA_VERSION := $(shell sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' $(KAFKA_POM))
KAFKA_LIBS ?= $(HOME)/.cache/alma-stream/kafka-$(KAFKA_VERSION)
KAFKA_STAMP := $(KAFKA_LIBS)/.fetched

.PHONY: up demo bench test check lint typecheck docs unit integration clean-venv tools lock image kafka kafka-if-java postgres15 faults

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) (PyTorch: $(TORCH))"
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --progress-bar on --no-deps --retries 1 --timeout 20 \
	  --index-url $(TORCH_INDEX) $(TORCH) || { \
	  echo "==> $(TORCH) is not to be had from $(TORCH_INDEX) here: installing PyPI's $(TORCH_PYPI)"; \
	  echo "    instead (a CUDA build that runs on the CPU: ~3 GB with its CUDA libraries)"; \
	  $(PY) -m pip install --progress-bar on $(TORCH_PYPI); }
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	@touch $(STAMP)

$(KAFKA_STAMP): $(KAFKA_POM)
	@command -v mvn >/dev/null || { echo "make kafka needs Maven (mvn) and Java 17+: install them (Debian: apt-get install maven openjdk-17-jdk-headless)"; exit 1; }
	@echo "==> Apache Kafka $(KAFKA_VERSION): copying the broker's jars into $(KAFKA_LIBS) (Maven)"
	mvn -B -q -f $(KAFKA_POM) dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory=$(KAFKA_LIBS)
	@touch $(KAFKA_STAMP)

kafka: $(KAFKA_STAMP)

# `alma up` and `alma demo` start Apache Kafka where Java and its jars are found, Tansu
# (in memory) otherwise: fetch the jars where Maven and Java are, go on without them
# where they are not.
kafka-if-java:
	@if command -v mvn >/dev/null && command -v java >/dev/null; then $(MAKE) --no-print-directory kafka; \
	else echo "==> no Maven or Java here: the embedded broker is Tansu (in memory); see README, Brokers"; fi

up: $(STAMP) kafka-if-java
	$(VENV)/bin/alma up

demo: $(STAMP) kafka-if-java
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

integration: $(STAMP) tools kafka
	$(PY) -m pytest tests/integration

# Test tools that come from Debian, not PyPI: Prometheus (a real server scrapes a
# worker in the tests), promtool (checks the alert rules), chromium with its driver
# (the run inspector's pages are tested in a headless browser), and for the cluster
# tests (tests/cluster) nftables (cuts one host off from some others), Patroni and etcd
# (PostgreSQL's primary and standby; the packages' own services are not started).
tools:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null \
	  && command -v chromium >/dev/null && command -v chromedriver >/dev/null \
	  && command -v nft >/dev/null && command -v patroni >/dev/null \
	  && command -v etcd >/dev/null || { \
	  echo "==> installing Debian's prometheus, chromium, chromium-driver, nftables, patroni"; \
	  echo "    and etcd-server (the tests use them)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    prometheus chromium chromium-driver nftables patroni etcd-server; }

# Guarantee 10's report: a cluster of real hosts on this machine (network namespaces,
# as root: three Apache Kafka brokers, PostgreSQL 15 as a primary and a standby under
# Patroni with etcd, Redis, two worker hosts, an orchestrator host), every fault
# scenario in its long form, one table (also written to build/faults.md). `make test`
# runs the short form (tests/cluster/test_faults.py).
faults: $(STAMP) tools kafka postgres15
	@mkdir -p build
	$(PY) -m tests.cluster --long --markdown build/faults.md

# The oldest PostgreSQL the tests run on (tests/integration/test_oldest_postgres.py):
# Debian's PostgreSQL 15, with pgvector built for it from the source of the version the
# embedded PostgreSQL 18 ships (the Go module proxy serves that tagged source; the
# checksum is pinned). Debian packages no pgvector for 15; apt-get as for `tools`.
PG_OLDEST := /usr/lib/postgresql/15
PGVECTOR := 0.8.6
PGVECTOR_SHA256 := 6abdf1f3361b12827922cf6e5d6b52c4d645aa65819cf6e25ce1f4897664b421
PGVECTOR_STAMP := /usr/share/postgresql/15/extension/vector--$(PGVECTOR).sql
postgres15: $(PGVECTOR_STAMP)
$(PGVECTOR_STAMP):
	@echo "==> PostgreSQL 15 with pgvector $(PGVECTOR) (the oldest PostgreSQL the tests run on)"
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  test -x $(PG_OLDEST)/bin/postgres -a -f /usr/include/postgresql/15/server/postgres.h || { \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	    postgresql-15 postgresql-server-dev-15 make gcc; } && \
	  rm -rf build/pgvector && mkdir -p build/pgvector && \
	  curl -fsSL --retry 3 -o build/pgvector/src.zip \
	    https://proxy.golang.org/github.com/pgvector/pgvector/@v/v$(PGVECTOR).zip && \
	  echo "$(PGVECTOR_SHA256)  build/pgvector/src.zip" | sha256sum -c --quiet && \
	  cd build/pgvector && python3 -m zipfile -e src.zip . && \
	  cd github.com/pgvector/pgvector@v$(PGVECTOR) && \
	  $(MAKE) --no-print-directory -s PG_CONFIG=$(PG_OLDEST)/bin/pg_config OPTFLAGS= with_llvm=no >/dev/null && \
	  $$SUDO $(MAKE) --no-print-directory -s PG_CONFIG=$(PG_OLDEST)/bin/pg_config with_llvm=no install >/dev/null || { \
	  echo "make postgres15: could not install PostgreSQL 15 with pgvector (above); the tests of the"; \
	  echo "oldest PostgreSQL need it: fix what it names (apt-get, the Go module proxy) and run again"; exit 1; }

# The documentation site (mkdocs.yml): the README as its front page, docs/, the changelog
# and the API reference from the docstrings, into build/site. Strict: a broken link, a
# missing page or a docstring the reference cannot read fails the build (and `make test`).
# Not --quiet: it hides the warnings from strict mode too (a broken anchor passed); the
# log is printed only when the build fails.
docs: $(STAMP)
	@log=$$($(PY) -m mkdocs build --strict 2>&1) || { echo "$$log"; \
	  echo "make docs: the documentation site does not build (above); fix the link or page it names"; exit 1; }

test: lint typecheck docs tools kafka postgres15
	$(PY) -m pytest

check: lint typecheck kafka
	$(PY) -m pytest -q --hypothesis-profile=quick -m "unit or smoke"

clean-venv:
	rm -rf $(VENV)

# Resolves `.[all]` afresh (newest versions pyproject.toml allows) beside PyPI's build of
# the image's PyTorch version, on Python 3.11, from a copy of the source (no build/ left
# here), with `pip install --dry-run --report`: only metadata is fetched, and PyTorch's
# CPU index need not be reachable. deploy/lock.py pins the CPU build in its place and
# leaves out the CUDA libraries only PyPI's build needs. The image installs exactly
# these (--no-deps) and fails its build (`pip check`) when the file is stale.
lock:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	echo "==> resolving '.[all]' with torch==$(IMAGE_TORCH_VERSION) on $(LOCK_PYTHON) (metadata only; about a minute)"; \
	$(LOCK_PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the image runs Python 3.11: set LOCK_PYTHON"'; \
	"$$tmp/venv/bin/pip" install --quiet --upgrade pip; \
	mkdir "$$tmp/src" && cp -R pyproject.toml README.md schemas alma_core consumers "$$tmp/src/"; \
	"$$tmp/venv/bin/pip" install --quiet --dry-run --ignore-installed --report "$$tmp/report.json" \
	  "$$tmp/src[all]" "torch==$(IMAGE_TORCH_VERSION)"; \
	"$$tmp/venv/bin/python" deploy/lock.py "$$tmp/report.json" $(IMAGE_TORCH) > $(LOCK).new; \
	mv $(LOCK).new $(LOCK); \
	echo "==> $(LOCK): $$(grep -vc '^#' $(LOCK)) packages"

image:
	docker build -f deploy/Dockerfile --build-arg TORCH=$(IMAGE_TORCH) --build-arg VERSION=$(VERSION) -t $(IMAGE) .
