# modeld: `make setup` once, then `make test` / `make run`. Everything lives in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup proto test test-fast lint fmt run bench bench-quick clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) ./scripts/setup.sh
	touch $@

# Regenerate modeld/v1 from proto/ (committed; tests/test_proto.py fails if they drift).
proto: setup
	$(PY) scripts/gen_proto.py

SOURCES := modeld runtime_client tests scripts bench

lint: setup
	$(PY) -m ruff check $(SOURCES)
	$(PY) -m ruff format --check $(SOURCES)
	$(PY) -m mypy

fmt: setup
	$(PY) -m ruff format $(SOURCES)
	$(PY) -m ruff check --fix $(SOURCES)

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

# Benchmarks: every system on the same prompts in one run; report in bench/results/.
bench: setup
	$(PY) -m bench

# The CI smoke run: tiny model, smaller sizes, fewer turns; fails on errors, never on timing.
bench-quick: setup
	$(PY) -m bench --quick

run: setup
	$(PY) -m modeld.demo $(if $(BACKEND),--backend $(BACKEND),) $(if $(MODEL),--model $(MODEL),)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build *.egg-info
