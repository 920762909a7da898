# Two entry points, each doing its own idempotent set-up in ./.venv:
#   make study   - run the main job (python -m phaze_opt.study --trials 500)
#   make test    - run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TRIALS ?= 500

.PHONY: setup study test

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

study: $(STAMP)
	$(BIN)/python -m phaze_opt.study --trials $(TRIALS)

test: $(STAMP)
	$(BIN)/python -m pytest -q
