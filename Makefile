# Two entry points, each doing its own idempotent set-up in ./.venv:
#   make study   - run the main job (python -m phaze_opt.study --trials 500)
#   make test    - run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TRIALS ?= 500

.PHONY: setup study test postgres

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

study: $(STAMP)
	$(BIN)/python -m phaze_opt.study --trials $(TRIALS)

# tests/test_study_postgres.py starts its own PostgreSQL server (127.0.0.1 only, in a temporary
# directory) to test Optuna's distributed mode; install the server binaries when they are missing.
postgres:
	@if command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql; \
	elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql; \
	else echo "PostgreSQL is needed by tests/test_study_postgres.py: install it (apt-get install postgresql)" >&2; exit 1; fi

test: $(STAMP) postgres
	$(BIN)/python -m pytest -q
