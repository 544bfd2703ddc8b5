# modeld: `make setup` once, then `make test` / `make run`. Everything lives in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup proto proto-check test test-fast lint fmt run clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) ./scripts/setup.sh
	touch $@

# Regenerate modeld/v1 from proto/ (committed; tests/test_proto.py fails if they drift).
proto: setup
	$(PY) scripts/gen_proto.py

lint: setup
	$(PY) -m ruff check modeld runtime_client tests scripts
	$(PY) -m ruff format --check modeld runtime_client tests scripts
	$(PY) -m mypy

fmt: setup
	$(PY) -m ruff format modeld runtime_client tests scripts
	$(PY) -m ruff check --fix modeld runtime_client tests scripts

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

run: setup
	$(PY) -m modeld.demo $(if $(BACKEND),--backend $(BACKEND),) $(if $(MODEL),--model $(MODEL),)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build *.egg-info
