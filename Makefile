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
# longer on 2 cores). Each test file runs on one worker (`--dist loadfile`: a module's
# fixtures, such as a parity reference or a shared server, are built once), in xdist's
# order, the files with the most tests first. The SLURM tests run beside the suite
# (their own local cluster, ports drawn by moerl.ports like every server's), and their
# output is printed after it: they spend much of their time waiting on SLURM (a
# requeued job's hold, its steps' start-up). With the suite's short unit tests first,
# the SLURM jobs start while little else needs the cores; starting the longest files
# first put the quick recipe's training runs, the benchmarks' smoke runs and the SLURM
# jobs on the two cores at once, and make test took longer (45:27 against 41:46 on a
# fresh clone, set-up included).
TEST_WORKERS ?= 2

test: lint typecheck
	@slurm_log=$$(mktemp); \
	$(VENV)/bin/pytest -q --durations=5 -m slurm tests/slurm > $$slurm_log 2>&1 & slurm=$$!; \
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile \
		--durations=15 -m "not slurm" tests; suite=$$?; \
	wait $$slurm; slurm_status=$$?; \
	echo "--- the SLURM tests (tests/slurm, run beside the suite)"; cat $$slurm_log; \
	rm -f $$slurm_log; \
	test $$suite -eq 0 && test $$slurm_status -eq 0

# Full sizes; `make test` runs each benchmark with --smoke
# (tests/integration/test_benchmarks_smoke.py). benchmarks/_*.py are their helpers.
# learning_vs_trl.py needs the bench extra (TRL), which scripts/setup.sh installs.
bench: setup
	for b in benchmarks/[!_]*.py; do $(PY) $$b || exit 1; done

gpu-smoke:
	scripts/gpu_smoke.sh
