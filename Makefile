# One command each, on a fresh machine with Python 3.11+ and make:
#   make demo    record an example agent against the stub model, replay it offline, show it
#   make test    the whole test suite
#   make bench   benchmarks, side by side with vcrpy
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.deja-installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "deja needs Python 3.11+")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	BIN=$(BIN) bash examples/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/run.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) cassettes/demo cassettes/.index.duckdb .pytest_cache
