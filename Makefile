# modeld: `make setup` once, then `make test` / `make run`. Everything lives in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup proto test test-fast lint fmt run bench bench-quick bench-compare bench-families bench-fleet bench-speculation chaos clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) ./scripts/setup.sh
	touch $@

# Regenerate modeld/v1 from proto/ (committed; tests/house/test_packaging.py fails if they drift).
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

# Benchmarks: every system on the same prompts in one run, then the agent-API loops, the families'
# loops (bench-families', ~30-40 min), speculation (bench-speculation's ~15 min) and the fleet
# behind smg (bench-fleet's, tens of minutes: its 8k prefills on the realistic model): ~110
# minutes on an otherwise idle 2-core box, far more under
# load (plus ~10 to build llama-server the first time); the report in bench/results/ merges the
# two newest runs. WORKLOAD=name[,name] runs only those (and what they continue; the extras
# agent_apis, families, claude_code, chat_agents, speculation, fleet, hybrid and overhead by
# name); its report stays in its run dir.
BENCH_ARGS = $(if $(WORKLOAD),--workload $(WORKLOAD),) $(if $(SYSTEMS),--systems $(SYSTEMS),)

bench: setup
	LLAMA_SERVER=$$(PYTHON=$(PY) ./scripts/build_llama_server.sh) && \
	$(PY) -m bench --llama-server "$$LLAMA_SERVER" $(BENCH_ARGS)

# The CI smoke run: tiny model, smaller sizes, fewer turns; fails on errors, never on timing.
# Speculation and the fleet run their quick forms (the SMALL copying model, 1 round of 32 tokens;
# the tiny model, 3 conversations of ~1k tokens): ~45 s of the smoke run's time. The families'
# loops run their quick form: 3 families' tiny models, 3 turns, modeld only (~15 s).
# Without llama-server (CI must stay fast and never build it); to include a built one:
# make bench-quick LLAMA_SERVER=$(./scripts/build_llama_server.sh --cached-only)
LLAMA_SERVER ?=
bench-quick: setup
	$(PY) -m bench --quick --llama-server "$(LLAMA_SERVER)" $(BENCH_ARGS)

# The fleet alone (blueprints/0020; make bench runs it too): 3 daemons behind smg, 6
# conversations of ~8k tokens, one daemon killed; a moved turn's TTFT against a cold re-prefill
# and against 3 llama-servers behind the same gateway (the realistic model: tens of minutes on 2
# cores, each 8k prefill takes a minute or more; FLEET_ARGS="--model tiny" takes a few minutes).
# Writes bench/results/fleet/report.md and a run-*.json beside it.
bench-fleet: setup
	LLAMA_SERVER=$$(PYTHON=$(PY) ./scripts/build_llama_server.sh) && \
	$(PY) -m bench.fleet --llama-server "$$LLAMA_SERVER" $(FLEET_ARGS)

# An agent loop per model family (issue 31; make bench runs it too): each family's template on the
# realistic model (a copy made per family, removed after), 5 turns over OpenAI chat against
# llama-server --jinja on the same requests: tokens computed and warm TTFT per turn. ~1-2 minutes
# a family on an idle 2-core box, far more under load. FAMILY=name[,name] runs only those.
# Writes bench/results/families/report.md and a run-*.json beside it.
bench-families: setup
	LLAMA_SERVER=$$(PYTHON=$(PY) ./scripts/build_llama_server.sh) && \
	$(PY) -m bench.families --llama-server "$$LLAMA_SERVER" $(if $(FAMILY),--family $(FAMILY),)

# The newest full run against the committed bench/results/results.json; fails when a ratio, an
# overhead row (ensure_prefix on an unchanged 8k prefix, worker IPC per turn, decode through the
# worker paired) or an extra's headline figure got worse beyond its measured run-to-run spread.
# RUN=path/to/run.json compares another run.
bench-compare: setup
	$(PY) -m bench.compare $(if $(RUN),--current $(RUN),)

# Chaos under load for 30 minutes (CI runs 45 s of it in tests/workers/test_chaos.py): agents and an
# OpenAI SDK chat while workers and the daemon are killed, the model file rewritten and a
# snapshot corrupted; prints the tally, fails on any violation (CHAOS_SECONDS=, CHAOS_SEED=).
CHAOS_SECONDS ?= 1800
CHAOS_SEED ?= 21
chaos: setup
	$(PY) tests/helpers/chaos.py --seconds $(CHAOS_SECONDS) --seed $(CHAOS_SEED)

run: setup
	$(PY) -m modeld.demo $(if $(BACKEND),--backend $(BACKEND),) $(if $(MODEL),--model $(MODEL),)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build *.egg-info

# Decode speed with speculation from the context alone (blueprint 0021; make bench runs it too):
# modeld with and without, and llama-server plain and with its n-gram modes, on the generated
# COPYING model (~15 minutes on 2 cores). Writes bench/results/speculation/<time>.md|json. QUICK=1: SMALL, 2 rounds.
bench-speculation: setup
	LLAMA_SERVER=$$(PYTHON=$(PY) ./scripts/build_llama_server.sh) && \
	$(PY) -m bench.speculation --llama-server "$$LLAMA_SERVER" $(if $(QUICK),--quick,) $(if $(THREADS),--threads $(THREADS),)
