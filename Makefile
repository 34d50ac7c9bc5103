# leasekeeper tasks. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
NPM ?= npm
BUF := node_modules/.bin/buf
BUF_BASELINE := protos/baseline/leasekeeper-v1.binpb
# npm packages: buf (root package.json), the TypeScript client (clients/typescript, built with
# tsc: the docs' js blocks import it through examples/node's link to it) and the Node.js
# example's gRPC libraries.
TS_DIR := clients/typescript
NODE_DEPS := node_modules/.installed $(TS_DIR)/dist/index.js examples/node/node_modules/.installed

.DEFAULT_GOAL := help

.PHONY: help serve test test-ts test-browser test-ha image-test lint protos protos-check protos-baseline demo bench bench-quick docs docs-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# `npm ci` installs exactly what the lock file says; again only when it changes.
node_modules/.installed: package.json package-lock.json
	@command -v $(NPM) >/dev/null || { echo "npm (Node.js 20+) is needed for buf: install Node.js" >&2; exit 1; }
	$(NPM) ci --no-audit --no-fund
	touch $@

$(TS_DIR)/node_modules/.installed: $(TS_DIR)/package.json $(TS_DIR)/package-lock.json
	@command -v $(NPM) >/dev/null || { echo "npm (Node.js 20+) is needed for clients/typescript: install Node.js" >&2; exit 1; }
	cd $(TS_DIR) && $(NPM) ci --no-audit --no-fund
	touch $@

$(TS_DIR)/dist/index.js: $(TS_DIR)/node_modules/.installed $(TS_DIR)/tsconfig.json $(shell find $(TS_DIR)/src -name '*.ts' 2>/dev/null)
	cd $(TS_DIR) && $(NPM) run build

examples/node/node_modules/.installed: examples/node/package.json examples/node/package-lock.json
	@command -v $(NPM) >/dev/null || { echo "npm (Node.js 20+) is needed for examples/node: install Node.js" >&2; exit 1; }
	cd examples/node && $(NPM) ci --no-audit --no-fund
	touch $@

serve: $(VENV)/.installed ## start the service (embedded PostgreSQL unless LEASEKEEPER_DATABASE_URL is set)
	$(VENV)/bin/leasekeeper serve

# The docs' and README's code blocks (tests/docs/blocks.py) run in a second pytest alongside the
# main suite: they spend most of their time waiting on the service, so together they take about
# as long as the main suite alone. Their report is printed after the main suite's.
DOCS_LOG := .pytest-docs.log
# The main suite runs in pytest-xdist workers (each with a database of its own: tests/conftest.py):
# most tests wait on real state (ttls running out, stopped processes, restarts), so three workers
# overlap their waits even on 2 cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3

test: $(VENV)/.installed $(NODE_DEPS) ## run the test suite and every code block of the docs (real PostgreSQL: local on :5432, else embedded)
	@$(PY) -m pytest -q -p no:cacheprovider docs README.md > $(DOCS_LOG) 2>&1 & docs=$$!; \
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist worksteal; main=$$?; \
	wait $$docs; docs_status=$$?; \
	echo "== the docs' and README's code blocks (run alongside; exit $$docs_status)"; \
	cat $(DOCS_LOG); \
	if [ $$main -ne 0 ]; then exit $$main; fi; exit $$docs_status

# The TypeScript client (clients/typescript): node:test against real `leasekeeper serve`
# processes (a fresh database on the local PostgreSQL, else the embedded one), then the package
# packed with `npm pack`, installed into an empty project and its quickstart run (the docs').
test-ts: $(VENV)/.installed node_modules/.installed $(TS_DIR)/node_modules/.installed ## the TypeScript client's tests against a real server, and its npm pack test
	cd $(TS_DIR) && $(NPM) test && $(NPM) run test:pack

# The console in a real browser: Debian's Chromium (/usr/bin/chromium, `apt-get install
# chromium`) driven by Playwright, against real `leasekeeper serve` processes. `make test`
# leaves these out (pyproject's addopts: -m "not browser"); this -m comes later and wins.
# Full-page screenshots of the pages each test saw go to build/screenshots/.
test-browser: $(VENV)/.installed ## the console's tests in Chromium (needs /usr/bin/chromium); screenshots in build/screenshots/
	$(PY) -m pytest -m browser tests/browser -p no:cacheprovider

# leasekeeper on a real Patroni cluster (Debian's patroni, etcd-server, haproxy and PostgreSQL):
# etcd and three PostgreSQL nodes on loopback, five faults of the primary under the history
# workload with synchronous replication, one lossy failover without; about 2.5 minutes on 2 cores.
# `make test` leaves these out (pyproject's addopts: -m "not ... ha"). The figures:
# build/ha/results.{json,md}, also printed at the end.
test-ha: $(VENV)/.installed ## the high-availability tier on Patroni (needs patroni, etcd-server, haproxy); build/ha/results.md
	$(PY) -m pytest -m ha tests/ha -p no:cacheprovider

# The Dockerfile built and its image run, with no Docker engine and no registry: Debian's
# debootstrap makes a bookworm base (cached in build/image/), buildah builds the Dockerfile on
# it and runs the entrypoint on the embedded and on the local PostgreSQL (tests/image/run.py).
# Root only; 1.5 to 5 minutes cold (debootstrap), about 1 warm. Figures: build/image/report.txt.
image-test: $(VENV)/.installed ## build the image (debootstrap + buildah, as root) and run it: health, a claim, SIGTERM; build/image/report.txt
	$(PY) -m tests.image.run

lint: $(VENV)/.installed protos-check ## ruff, mypy, and buf on the protos (protos-check)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy server client

protos: $(VENV)/.installed node_modules/.installed $(TS_DIR)/node_modules/.installed ## regenerate the Python and TypeScript stubs from protos/
	$(PY) scripts/gen_protos.py
	cd $(TS_DIR) && $(NPM) run generate

protos-check: node_modules/.installed ## buf lint, and buf breaking against the published baseline
	$(BUF) lint
	$(BUF) breaking --against $(BUF_BASELINE)

protos-baseline: node_modules/.installed ## publish protos/ as the new breaking-change baseline
	$(BUF) build -o $(BUF_BASELINE)

bench: $(VENV)/.installed ## the benchmark suite (about 30 minutes): bench/results/results.{md,json,png}
	$(PY) -m bench.run

bench-quick: $(VENV)/.installed ## the benchmark suite in short windows (about 3-4 minutes; CI runs it)
	$(PY) -m bench.run --quick --out bench/results/quick

demo: $(VENV)/.installed ## the paused-worker, crashed-worker and resumed-run scenarios on real processes
	$(PY) examples/demo.py

# MkDocs 1.x is pinned (<2); its plugins print a notice about a future 2.0 at every build.
export DISABLE_MKDOCS_2_WARNING := true
export NO_MKDOCS_2_WARNING := 1

docs: $(VENV)/.installed ## build the documentation site strictly, then serve it on http://127.0.0.1:8000
	$(VENV)/bin/mkdocs build --strict
	$(VENV)/bin/mkdocs serve --strict

docs-check: $(VENV)/.installed ## build the documentation site strictly into site/ (a broken link fails; CI runs it)
	$(VENV)/bin/mkdocs build --strict

clean: ## remove the virtual environment and the npm packages
	rm -rf $(VENV) node_modules examples/node/node_modules site
	rm -rf $(TS_DIR)/node_modules $(TS_DIR)/dist $(TS_DIR)/build
