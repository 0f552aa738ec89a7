# tpkit: every target sets itself up on a fresh machine (venv, pinned CPU torch, the package).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cu128"
TORCH_PIP_ARGS ?=
# The tested versions of everything else; CONSTRAINTS= VENV=.venv-latest for the newest releases.
CONSTRAINTS ?= constraints.txt
NPROC ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.tpkit-installed-$(TORCH_VERSION)$(if $(CONSTRAINTS),-pinned,-latest)

.PHONY: install test test-quick demo lint format bench docs clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip || true
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -q -e ".[test,quant,docs]" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers (pytest-xdist), each taking whole files: a file's module fixtures and each
# worker's session rank groups (tests/conftest.py) are shared as before; on 2 cores this keeps
# the second core busy while a test runs in one process. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) tests

# The inner loop: the house rules, the plan data, the sizes and the styles (single process), and
# one split of each kind on 2 ranks, in about two minutes; `make test` before a commit.
QUICK ?= tests/test_docs.py tests/test_plan_spec.py tests/test_parallel_dims.py tests/test_config.py \
	tests/test_styles.py tests/test_settle.py tests/test_extensions.py tests/test_parallelize.py

test-quick: install
	$(BIN)/python -m pytest -q -n $(NPROC) --dist loadfile $(QUICK)

demo: install
	PATH="$(abspath $(BIN)):$$PATH" bash launch/torchrun.sh --nproc $(NPROC) examples/demo.py

lint: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

format: install
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

bench: install
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The manual (docs/ + the API reference from docstrings) into site/; --strict: a broken link or
# an unreadable docstring fails (tests/test_docs.py builds it too, so `make test` checks it).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache
