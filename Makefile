# Set-up and everyday commands. `make up` and `make test` work on a fresh machine:
# each creates the virtual environment it needs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test test-slow proto lint bench venv clean

up: $(STAMP)
	$(VENV)/bin/cachesvc up --nodes 3 --demo

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

proto: $(STAMP)
	$(PY) proto/generate.py

lint: $(STAMP)
	$(VENV)/bin/ruff check cachesvc client tests bench proto
	$(VENV)/bin/mypy cachesvc client/cacheclient

bench: $(STAMP)
	$(PY) bench/tiers.py

venv: $(STAMP)

# torch first, pinned: it comes from a local file here; an unpinned torch
# (pulled in by anything else) would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) state .pytest_cache
