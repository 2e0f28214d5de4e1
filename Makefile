# Every target creates .venv and installs what it needs: on a fresh machine
# `make demo` and `make test` are the whole set-up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-oldest test-repeat test-all faults tools torch frameworks bench results docs proto lint typecheck dist clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dataquay demo

# Test processes at once: most tests wait on daemons, so two keep a 2-core
# machine busy (the suite takes half as long again with one). A worker that
# runs out of tests takes queued ones from the other (worksteal), so the run
# does not end on one worker's queue of long cluster tests.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist worksteal

test: lint docs tools torch frameworks
	$(BIN)/python -m pytest -q $(XDIST)

# The suite N times over, each run in a fresh temp dir and without pytest's
# cache, to show it does not flake; stops at the first run that fails.
N ?= 5
test-repeat: $(STAMP) tools torch frameworks
	@for i in $$(seq 1 $(N)); do \
	  base=$$(mktemp -d) && echo "== run $$i of $(N) (temp dir $$base)" && \
	  $(BIN)/python -m pytest -q $(XDIST) -p no:cacheprovider --basetemp="$$base" || \
	    { echo "run $$i of $(N) failed; its files are under $$base"; exit 1; }; \
	  rm -rf "$$base"; \
	done; echo "all $(N) runs passed"

# The tests at the lowest versions pyproject.toml declares (each runtime floor
# pinned by .ci/oldest-constraints), in an environment of their own: a floor
# the code has outgrown fails here, not in a user's pinned environment.
OLDEST := .venv-oldest
OLDEST_TESTS ?= tests/test_daemon.py tests/test_client_reads.py tests/test_sampler.py tests/test_stage_numbers.py \
	tests/test_status_numbers.py tests/test_cluster.py tests/test_exchange.py tests/test_pfs_pool.py
test-oldest: pyproject.toml
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python .ci/oldest-constraints pyproject.toml > $(OLDEST)/constraints.txt
	$(OLDEST)/bin/python -m pip install --quiet -c $(OLDEST)/constraints.txt -e '.[dev]'
	$(OLDEST)/bin/python -m pip check
	$(OLDEST)/bin/python -m pytest -q $(XDIST) $(OLDEST_TESTS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

# The fault-injection suite alone, and its table for docs/reliability.md.
faults: $(STAMP)
	rm -f bench/results/faults.jsonl
	DATAQUAY_FAULT_REPORT=bench/results/faults.jsonl $(BIN)/python -m pytest -q tests/faults
	$(BIN)/python tests/faults/report.py bench/results/faults.jsonl

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,docs,bench]'
	$(BIN)/python bench/run.py

# The plots of docs/results.md and the README, drawn from bench/results/*.json.
results: $(STAMP)
	$(BIN)/python bench/plots.py

# The documentation site into site/; --strict makes every warning (a broken
# link, a page left out of the nav) an error, so CI checks the docs as code.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet --site-dir site

# The deploy tests verify the systemd units, lint the Slurm scripts, run them
# under a real slurmctld and slurmd, and check the Prometheus rules and a real
# Prometheus with these tools; the clock-step tests run the directory under
# libfaketime; the directory's etcd store tests run a real etcd. As root on a Debian-like machine (CI) they are installed here;
# elsewhere, or if that fails, those tests skip and say why.
DEPLOY_TOOLS := systemd-analyze shellcheck promtool prometheus slurmctld slurmd sbatch scontrol faketime etcd
DEPLOY_PACKAGES := systemd shellcheck prometheus slurmctld slurmd slurm-client faketime etcd-server
tools:
	@(for tool in $(DEPLOY_TOOLS); do command -v $$tool >/dev/null || exit 1; done) || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    timeout 600 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEPLOY_PACKAGES)' \
	    >/dev/null 2>&1; } || \
	  echo "some of $(DEPLOY_TOOLS) missing: the deploy tests that need them will skip"

# The PyTorch adapters' tests run against real PyTorch where pip has a build
# of it on this machine (its find-links: a CPU build on CI's machines); pip
# takes it alone first, so that nothing downloads a CUDA build of several GB.
# Elsewhere they skip; `pip install torch` into .venv runs them.
TORCH ?= torch==2.13.0
torch: $(STAMP)
	@$(BIN)/python -c 'import torch' 2>/dev/null || \
	  { $(BIN)/python -m pip install --quiet --no-index --no-deps '$(TORCH)' >/dev/null 2>&1 && \
	    $(BIN)/python -m pip install --quiet --quiet '$(TORCH)'; } || \
	  { $(BIN)/python -m pip uninstall --quiet --yes torch >/dev/null 2>&1; \
	    echo "no $(TORCH) on this machine without a download: the PyTorch adapter tests will skip"; }

# The JAX, grain, TensorFlow and torchdata tests and the examples they run
# (1.9 GB in .venv; about 25 s where pip has them cached). A download that
# does not finish in FRAMEWORKS_SECONDS leaves them out and their tests
# skip, each saying which package it lacks. The protobuf and grpcio floors keep pip
# from downgrading what the committed generated code checks at import.
FRAMEWORKS ?= torchdata grain jax jaxlib tensorflow-cpu
FRAMEWORKS_SECONDS ?= 300
frameworks: torch
	@$(BIN)/python -c 'import torchdata, grain, jax, tensorflow' 2>/dev/null || \
	  timeout $(FRAMEWORKS_SECONDS) $(BIN)/python -m pip install --quiet $(FRAMEWORKS) 'protobuf>=7.35.1' 'grpcio>=1.85.1' >/dev/null 2>&1 || \
	  echo "$(FRAMEWORKS) not installed in $(FRAMEWORKS_SECONDS) s: their tests will skip"

proto: $(STAMP)
	$(BIN)/python protos/generate.py

# ruff's rules and exclusions (the generated *_pb2*.py) are in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check client server protos tests bench examples
	$(BIN)/ruff format --check client server protos tests bench examples

typecheck: $(STAMP)
	$(BIN)/python -m mypy client/dataquay/client client/dataquay/analyze server/dataquay/server

# dist/: the sdist, and a wheel built from it for this machine, which must hold
# the compiled extension (an install without a compiler falls back to Python
# loops; a wheel must not). Wheels for every Linux come from cibuildwheel, set
# up in pyproject.toml: `cibuildwheel --platform linux` where Docker runs.
PEP517 = $(CURDIR)/$(BIN)/python -c 'import sys; from setuptools import build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))'
dist: $(STAMP)
	rm -rf dist
	$(PEP517) build_sdist dist
	tmp=$$(mktemp -d) && tar xzf dist/*.tar.gz -C $$tmp && \
	  (cd $$tmp/* && $(PEP517) build_wheel $(CURDIR)/dist); status=$$?; rm -rf $$tmp; exit $$status
	$(BIN)/python -c 'import glob, sys, zipfile; \
	  sys.exit(None if any(n.endswith(".so") for n in zipfile.ZipFile(glob.glob("dist/*.whl")[0]).namelist()) \
	  else "dist: the wheel has no compiled extension (is a C compiler installed?)")'

clean:
	rm -rf $(VENV) build dist site *.egg-info
