# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test lint typecheck unit bench constraints dist clean

# The runtime dependencies are installed at the versions the container image pins
# (deploy/constraints.txt), so the tests run with what the image ships.
$(STAMP): pyproject.toml deploy/constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c deploy/constraints.txt -e '.[dev]'
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

# The benchmarks (bench/README.md): never part of `make test`, never pass or fail.
# Arguments pass through: `make bench ARGS=--quick`, `make bench ARGS="drain backlog"`.
bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

# Every scenario at reduced sizes, in about two minutes.
.PHONY: bench-quick
bench-quick: $(STAMP)
	$(BIN)/python -m bench --quick $(ARGS)

# The fault suite's soak (tests/faults/soak.py): 30 minutes of mixed faults against two
# relays, then the history checker; never part of `make test`. `make soak ARGS="--minutes 5"`.
.PHONY: soak
soak: $(STAMP)
	$(BIN)/python -m tests.faults.soak $(ARGS)

# The source distribution and the wheel built from it, into dist/ (docs/install.md):
# `pip install dist/relayd-*.whl` on the machine that runs relayd, with the extras it needs.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .

# Re-pin the image's runtime dependencies to what .venv has (after upgrading it on purpose).
constraints: $(STAMP)
	$(BIN)/python -m tests.deploy.pins > deploy/constraints.txt.new
	mv deploy/constraints.txt.new deploy/constraints.txt

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
