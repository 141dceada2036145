# kvtool — set-up and common tasks. Everything goes into ./.venv.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo lint test test-fast soak soak-storage soak-http bench clean

$(STAMP): pyproject.toml requirements.lock requirements-test.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -c requirements-test.lock -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

## demo: install, then serve the same long prompt in two processes (second one hits the SSD tier)
demo: $(STAMP)
	rm -rf .demo-cache && mkdir -p .demo-cache/out
	@echo "== embedded model (random weights: gibberish text, real KV cache): $$($(BIN)/kvtool model path tiny)"
	@echo "== process 1: cold cache, prefill everything, write the prompt's blocks to SSD"
	KVTOOL_CACHE_DIR=.demo-cache/kv $(BIN)/kvtool serve-once --json --prompt-file kvtool/assets/demo_prompt.txt --max-tokens 16 > .demo-cache/out/cold.json
	@echo "== process 2: a restart, empty RAM: the blocks come from SSD"
	KVTOOL_CACHE_DIR=.demo-cache/kv $(BIN)/kvtool serve-once --json --prompt-file kvtool/assets/demo_prompt.txt --max-tokens 16 > .demo-cache/out/warm.json
	@$(BIN)/python scripts/demo_summary.py .demo-cache/out/cold.json .demo-cache/out/warm.json

## lint: ruff (style, import order, likely bugs) over the code, tests and scripts; mypy over kvtool/
lint: $(STAMP)
	$(BIN)/ruff check kvtool tests bench_configs scripts
	$(BIN)/mypy

## test: install, lint, then run the whole test suite (two pytest-xdist workers: the machine's 2 cores)
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

## test-fast: the suite without the tests marked slow (subprocesses, servers, sleeps), for development
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow"

## soak: both soaks below (storage 300 s, then 10 minutes of hostile HTTP beside 4 normal clients)
soak: soak-storage soak-http

## soak-storage: concurrent processes, SIGKILL and the maintenance commands on one cache (KVTOOL_SOAK_SECONDS, default 300)
soak-storage: $(STAMP)
	KVTOOL_SOAK_SECONDS=$${KVTOOL_SOAK_SECONDS:-300} $(BIN)/python -m pytest -q -s tests/test_soak.py

## soak-http: kvtool serve with a hostile client beside 4 normal ones for longer (KVTOOL_SOAK_SECONDS, default 600)
soak-http: $(STAMP)
	KVTOOL_SOAK_SECONDS=$${KVTOOL_SOAK_SECONDS:-600} $(BIN)/python -m pytest -q -s tests/test_soak_http.py

bench: $(STAMP)
	$(BIN)/kvtool bench bench_configs/quick.toml

clean:
	rm -rf $(VENV) .demo-cache .pytest_cache .mypy_cache .ruff_cache
