# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,embedded]'
	@touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/relayd demo

lint: $(STAMP)
	$(BIN)/ruff check relayd tests bench
	$(BIN)/ruff format --check relayd tests bench

typecheck: $(STAMP)
	$(BIN)/mypy relayd tests bench

test: lint typecheck
	$(BIN)/pytest

unit: $(STAMP)
	$(BIN)/pytest tests/unit

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
