# The two commands a newcomer runs: `make demo` and `make test`. Both set up .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# the ray extra too, so that the Ray tests run rather than skip
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/magis demo

test: setup
	$(PY) -m pytest -n 2 tests

lint: setup
	$(VENV)/bin/ruff check magis tests
	$(VENV)/bin/ruff format --check magis tests

format: setup
	$(VENV)/bin/ruff format magis tests
	$(VENV)/bin/ruff check --fix magis tests

clean:
	rm -rf $(VENV) .pytest_cache
