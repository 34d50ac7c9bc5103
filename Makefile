# leasekeeper tasks. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.DEFAULT_GOAL := help

.PHONY: help serve test lint protos demo clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

serve: $(VENV)/.installed ## start the service (embedded PostgreSQL unless LEASEKEEPER_DATABASE_URL is set)
	$(VENV)/bin/leasekeeper serve

test: $(VENV)/.installed ## run the test suite (real PostgreSQL: local on :5432, else embedded)
	$(PY) -m pytest

lint: $(VENV)/.installed ## ruff and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy server client

protos: $(VENV)/.installed ## regenerate the Python stubs from protos/
	$(PY) scripts/gen_protos.py

demo: $(VENV)/.installed ## the paused-worker and crashed-worker scenarios on real processes
	$(PY) examples/demo.py

clean: ## remove the virtual environment
	rm -rf $(VENV)
