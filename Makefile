# One command each, on a fresh machine with Python 3.11+ and make:
#   make demo    record an example agent against the stub model, replay it offline, show it
#   make test    ruff and mypy (make check), then the whole test suite
#   make bench   benchmarks, side by side with vcrpy, agent-rewind and the SDK's floor
#   make wheel   the wheel to install deja into a project from (dist/)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.deja-installed
BENCH_STAMP := $(VENV)/.deja-bench-installed

.PHONY: demo check test stress bench lint clean chromium node postgres wheel bytecode

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "deja needs Python 3.11+")'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP) bytecode
	BIN=$(BIN) bash examples/demo.sh

# The wheel a project installs deja from (dist/deja_replay-VERSION-py3-none-any.whl).
# Only pip is needed: the build backend (hatchling) is fetched into an isolated build.
wheel: | $(BIN)/python
	$(BIN)/python -m pip wheel -q --no-deps -w dist .

# The viewer's browser test drives Debian's chromium (Playwright never downloads a browser).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The proxy's tests drive the official TypeScript SDK, the Vercel AI SDK and curl: Node.js,
# npm and curl from Debian when they are missing, then the example agents' locked packages.
node:
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
	  && command -v curl >/dev/null 2>&1 || { \
	  echo "installing Debian's nodejs, npm and curl for the proxy tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm curl; }
	@test -f examples/node-agent/node_modules/@anthropic-ai/sdk/package.json || \
	  (cd examples/node-agent && npm ci --no-audit --no-fund)
	@test -f examples/vercel-agent/node_modules/@ai-sdk/anthropic/package.json \
	  && test -f examples/vercel-agent/node_modules/ai/package.json || \
	  (cd examples/vercel-agent && npm ci --no-audit --no-fund)
	@test -f examples/mcp-node-agent/node_modules/@modelcontextprotocol/sdk/package.json || \
	  (cd examples/mcp-node-agent && npm ci --no-audit --no-fund)

# The durable-runs tests start a throwaway PostgreSQL server of their own (tests/pg_server.py)
# from Debian's binaries; a cluster the package itself starts on port 5432 is never used.
# The durable-runs tests start throwaway Postgres servers (never a mock): Debian's server.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  echo "installing Debian's postgresql for the durable-runs tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; }

# deja's own modules compiled ahead: the suite, the demo and the benchmarks start hundreds
# of Python processes that import them, and where PYTHONDONTWRITEBYTECODE is set none of
# them would keep what it compiled (half of deja's import time). Only what changed is
# compiled again; a stale file is never used (Python checks each against its source).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -x node_modules deja recorder replayer viewer tests examples bench >/dev/null

# Lint and type check: quick, so the suite runs only on code that passes them.
check: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/mypy

# Two test processes, each taking whole files (a file's servers and ports stay together),
# in the order tests/conftest.py collects them: the longest files first.
test: $(STAMP) chromium node postgres check bytecode
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# Long sweeps; the last writes the chaos table, docs/chaos.md (as root: full disks are tmpfs).
stress: $(STAMP) node postgres bytecode
	DEJA_CRASH_SEEDS=200 $(BIN)/python -m pytest tests/replayer/test_crash_resume.py
	DEJA_WORKER_SEEDS=100 $(BIN)/python -m pytest tests/runs/test_worker_death.py
	DEJA_TAMPER=full $(BIN)/python -m pytest tests/replayer/test_tamper.py
	DEJA_CHAOS=full $(BIN)/python -m pytest tests/runs/test_chaos.py

# The benchmark's extra anchors (agent-rewind), installed once beside the test extras.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) node postgres bytecode
	$(BIN)/python bench/run.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) cassettes/demo .deja/index .pytest_cache dist
	find deja recorder replayer viewer tests examples bench -name __pycache__ -prune -exec rm -rf {} +
