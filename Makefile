# Two entry points, each doing its own idempotent set-up in ./.venv:
#   make study   - run the main job (python -m phaze_opt.study --trials 500)
#   make test    - run the test suite
# Needs Python 3.11 or newer; `make study PYTHON=python3.12` picks the interpreter. The venv gets the
# exact tested set (requirements.lock) and the project itself, editable. `--no-compile`: pip would
# byte-compile all 16,000 modules of the set one by one (about a minute); Python compiles the few
# thousand a run imports as it first imports them, and keeps them.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TRIALS ?= 500

# A venv left by an older Python, by a failed install or by another interpreter than the PYTHON asked
# for is rebuilt, not reused: its state is found here, before make decides what is out of date.
ifeq ($(origin PYTHON),default)
PYTHON := python3
WANT :=
else ifeq ($(origin PYTHON),undefined)
PYTHON := python3
WANT :=
else
WANT := $(PYTHON)
endif
PYVER := import sys; print("%d.%d" % sys.version_info[:2])
# A PYTHON that does not run (not on PATH, or a pyenv shim for a version not installed) says so
# (nointerp) and leaves the venv as it is: it is not "another Python" to rebuild for, nor one too old.
RUNS = $(1) -c 'import sys' >/dev/null 2>&1
VENV_STATE := $(shell \
	if [ ! -e $(VENV) ]; then echo missing; \
	elif ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then echo broken; \
	elif [ -n "$(WANT)" ] && ! $(call RUNS,$(WANT)); then echo nointerp; \
	elif [ -n "$(WANT)" ] && [ "$$($(BIN)/python -c '$(PYVER)')" != "$$($(WANT) -c '$(PYVER)' 2>/dev/null)" ]; then echo other; \
	else echo ok; fi)
NOT_FOUND = echo "error: PYTHON=$(PYTHON) was not found (no such interpreter on PATH, or it does not run). Install it, or name one that runs: make $(or $(MAKECMDGOALS),setup) PYTHON=/path/to/python3.11-or-newer" >&2; exit 1

.PHONY: setup study test postgres FORCE

setup: $(STAMP)

ifneq ($(VENV_STATE),ok)
$(STAMP): FORCE
endif

$(STAMP): pyproject.toml requirements.lock
	@case "$(VENV_STATE)" in \
	nointerp) $(NOT_FOUND);; \
	broken) echo "$(VENV) does not run a Python >= 3.11 (left by another Python or a failed install): rebuilding it"; rm -rf $(VENV);; \
	other) echo "$(VENV) was built by another Python than PYTHON=$(PYTHON): rebuilding it"; rm -rf $(VENV);; \
	esac
	@test -x $(BIN)/python || $(call RUNS,$(PYTHON)) || { $(NOT_FOUND); }
	@test -x $(BIN)/python || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
		echo "error: phaze_opt needs Python 3.11 or newer; PYTHON=$(PYTHON) is '$$($(PYTHON) --version 2>&1)'." >&2; \
		echo "       Install one (e.g. apt-get install python3.12-venv) and run: make $(or $(MAKECMDGOALS),setup) PYTHON=python3.12" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -r requirements.lock -e '.[test]'
	touch $@

FORCE:

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

# The tests run in parallel, one process per core (pytest-xdist; `make test TEST_JOBS=0` runs them in
# this process alone): CI's budget is 20 minutes and the suite is about 28 minutes of one core.
# `--durations=20`: the log names the slowest tests (tests/conftest.py runs the longest first).
TEST_JOBS ?= auto
test: $(STAMP) postgres
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --durations=20
