# Every target creates .venv and installs what it needs: on a fresh machine
# `make demo` and `make test` are the whole set-up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench proto lint typecheck clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dataquay demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

bench: $(STAMP)
	$(BIN)/python bench/run.py

proto: $(STAMP)
	$(BIN)/python protos/generate.py

typecheck: $(STAMP)
	$(BIN)/python -m mypy client/dataquay/client server/dataquay/server

clean:
	rm -rf $(VENV) build *.egg-info
