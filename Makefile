# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up into
# .venv (torch 2.13.0 CPU build first, so nothing pulls a multi-GB CUDA build), idempotently.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.omniinfer-installed
DEPS   := pyproject.toml $(wildcard plugins/*/pyproject.toml)
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow test-all lint clean

$(STAMP): $(DEPS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' -e plugins/cpu -e plugins/cuda -e plugins/rocm -e plugins/xpu
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/omniinfer generate

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# the slow tier alone (CI runs it after `make test`), with lm-evaluation-harness for its test
test-slow: lint
	$(PY) -m pip install -q -e '.[eval]'
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

test-all: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
