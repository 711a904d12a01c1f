# Two commands for a fresh machine: `make demo` and `make test`. Both are idempotent.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: demo test lint typecheck unit system-deps clean

system-deps:
	@if ! command -v bwrap >/dev/null 2>&1; then \
	  echo "installing bubblewrap (sandbox)"; \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap >/dev/null; fi; \
	fi
	@# PostgreSQL server binaries for the `postgres` tests, which start their own server.
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  echo "installing postgresql (service tests)"; \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; fi; \
	fi
	@# WordNet 3.0 for the meteor metric of OpenAI text_similarity graders (never downloaded
	@# at run time).
	@if [ ! -f /usr/share/wordnet/data.noun ]; then \
	  echo "installing wordnet-base (meteor metric)"; \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wordnet-base) >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wordnet-base >/dev/null; fi; \
	fi
	@# Debian's Chromium (it pulls the libraries it needs) for the `browser` tests, which
	@# drive it with Playwright; Playwright's own browser downloads are never used.
	@if ! command -v chromium >/dev/null 2>&1; then \
	  echo "installing chromium (dashboard browser tests)"; \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, the CPU wheel; everything after accepts it, so nothing pulls a CUDA build.
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev,ray]'
	@touch $(STAMP)

demo: system-deps $(STAMP)
	$(VENV)/bin/marlaas demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Two workers (this machine's cores): much of the suite waits on live servers and
# subprocesses; a file's tests stay on one worker (module-scoped servers).
unit: $(STAMP)
	$(VENV)/bin/pytest -q -n auto --dist loadfile

test: system-deps $(STAMP) lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
