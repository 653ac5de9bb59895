"""How `make test` spreads the suite over two pytest workers (pytest-xdist).

Each test file runs on one worker (its module fixtures, such as a parity reference
or a shared server, are built once), and, where SLURM tests run under xdist, they
share one worker (one local cluster). Many tests wait on servers, sandboxes and
subprocesses, so two files at a time keep both cores busy. `make test` runs the SLURM
tests afterwards in a pytest of their own (Makefile).
"""

from __future__ import annotations

import pytest

# The suite leaves no process behind: tests/leftover_processes.py.
pytest_plugins = ["leftover_processes"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
