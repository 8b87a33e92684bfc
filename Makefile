# slo-router: the two commands a user needs are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PACKAGES := router predictor cms workers bench
PKG_DIRS  = $(wildcard $(PACKAGES))

.PHONY: test run lint typecheck proto proto-check bench system-deps venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

system-deps:
	@scripts/ensure_system_deps.sh

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

proto-check: $(STAMP)
	$(PY) scripts/gen_proto.py --check

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy $(PKG_DIRS) scripts

## test: install what is missing, check generated code, lint, type-check, run the whole suite
test: system-deps $(STAMP) proto-check lint typecheck
	$(VENV)/bin/pytest -q

## run: the embedded-cluster demo (for now: a prediction from the bundled profiles)
run: $(STAMP)
	$(VENV)/bin/slo-router predict \
	    --ttft-profiling-data-path profiling_data/qwen2.5-7b-2xv100-linear/ttft.json \
	    --tpot-profiling-data-path profiling_data/qwen2.5-7b-2xv100-linear/tpot.json \
	    --prefill-tokens 2048 --decode-requests 32 --decode-tokens 32768 --max-num-batched-tokens 2048

## bench: print the speed figures (no assertions)
bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
