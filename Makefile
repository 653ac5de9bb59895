# Two entry points: `make demo` (set up, then the default post-training demo) and
# `make test` (set up, then lint, type-check and the whole test suite).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint typecheck bench gpu-smoke

setup:
	@scripts/setup.sh

demo: setup
	$(VENV)/bin/moerl demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/lint-imports

typecheck: setup
	$(VENV)/bin/mypy

# Two pytest workers (pytest-xdist): many tests wait on servers and subprocesses, so two
# files at a time keep both cores busy (three made every test slower, the suite 6 min
# longer on 2 cores). Each test file runs on one worker (`--dist loadfile`: a module's fixtures, such as a parity
# reference or a shared server, are built once), the longest files first
# (tests/conftest.py's order, which `--no-loadscope-reorder` keeps: xdist would
# otherwise start the files with the most tests). The SLURM tests run afterwards on
# their own: a requeued job's second attempt re-binds ports and relaunches steps,
# which other tests' servers and load must not race.
TEST_WORKERS ?= 2

test: lint typecheck
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m "not slurm" tests
	$(VENV)/bin/pytest -q --durations=5 -m slurm tests/slurm

# Full sizes; `make test` runs each benchmark with --smoke
# (tests/integration/test_benchmarks_smoke.py). benchmarks/_*.py are their helpers.
# learning_vs_trl.py needs the bench extra (TRL), which scripts/setup.sh installs.
bench: setup
	for b in benchmarks/[!_]*.py; do $(PY) $$b || exit 1; done

gpu-smoke:
	scripts/gpu_smoke.sh
