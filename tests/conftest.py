"""The suite leaves no process behind (tests/leftover_processes.py), and its longest
files start first.

`make test` spreads the tests over pytest workers, each test file on one worker, handed
out in collection order (pytest-xdist's `--dist loadfile --no-loadscope-reorder`,
Makefile). Files marked `long(minutes=M)` (servers, ranks and training; M about what
the file takes on 2 cores) are collected first, longest first, so that they run while
the many short files fill the gaps and the end: a long file left for last would run
alone while the other workers idle. `make test` runs the SLURM tests beside the suite in
a pytest of their own, without workers (one local cluster).
"""

from __future__ import annotations

import pytest

pytest_plugins = ["leftover_processes"]


def _minutes(item: pytest.Item) -> float:
    marker = item.get_closest_marker("long")
    return 0.0 if marker is None else float(marker.kwargs.get("minutes", 1))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    minutes: dict[object, float] = {}
    for item in items:
        minutes[item.path] = max(minutes.get(item.path, 0.0), _minutes(item))
    items.sort(key=lambda item: -minutes[item.path])  # stable: the order inside a file kept
